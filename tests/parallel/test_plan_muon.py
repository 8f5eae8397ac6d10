"""The planner's figures of train.optimizer=muon's step (plan/optimizer_states.owner_step: what
its step-time model charges, plan/dp_comm.whole_matrix_step) against the bytes the trainer's
collectives move in a real step (comm stats in metrics.jsonl, rank 0, the tiny llama of the
parity tests):

- tp2 (ZeRO-0: every rank steps every Muon matrix): the TP gathers carry the planner's gathered
  elements in bf16, 2 bytes each (comm_bytes/muon_tp_gather: each rank's shard payload);
- dp2 ZeRO-1: the owners' broadcasts carry every Muon parameter of the rank once, in fp32
  (comm_bytes/broadcast_dp).

The planner reads the parameters off the modules on the meta device; the trainer counts what
it sends: a parameter the planner puts in the wrong group, or a gather it forgets, shows.
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import TINY, train_records

MUON = ["model.arch=llama", "train.optimizer=muon", "train.steps=1"]


def planner(overrides: list[str], world: int) -> tuple[float, int, int]:
    from megatron_lite.config import load_config
    from megatron_lite.plan.activations import resolved
    from megatron_lite.plan.optimizer_states import owner_step

    cfg = resolved(load_config(None, [*TINY, *MUON, *overrides]), world)
    return owner_step(cfg, 0)


@pytest.mark.parametrize(
    "layout, world, kind, bytes_per",
    [
        (["parallel.tp=2"], 2, "muon_tp_gather", 2),
        (["parallel.zero_stage=1"], 2, "broadcast_dp", 4),
    ],
    ids=["tp2-gathers", "dp2-zero1-broadcasts"],
)
@pytest.mark.timeout(180)
def test_planner_counts_muons_collectives(layout, world, kind, bytes_per):
    _, gathered, whole = planner(layout, world)
    key = f"comm_bytes/{kind}"
    record = train_records(world, [*MUON, *layout], (key,))[0]
    expected = bytes_per * (gathered if kind == "muon_tp_gather" else whole)
    assert expected > 0
    assert record[key] == expected, f"{kind}: measured {record[key]} B, planner {expected} B"
