"""The bytes train.optimizer=muon's own collectives move in one optimizer step, as comm stats
(parallel/comm_stats.py) records them, against the count each collective is published with
(muon.py, whole_matrix.py, fsdp_whole_matrix.py, docs/muon.md), computed here from the
parameter shapes alone. The model is tests/parallel/encoder_model.py's (fp32, 2 blocks);
Muon steps its matrices but the word embedding (the default kinds: its block matrices, the
learned positions and the head are "hidden"), AdamW the rest. Per rank, with S the Muon
parameters' elements on the rank (its TP shard) and fp32 weights:

- ZeRO-1/2 (whole_matrix.broadcast_params): kind "broadcast_dp", one broadcast per Muon
  parameter from its owner over the dp group: payload and bus bytes both 4·S;
- TP (muon._gather_tp): kind "muon_tp_gather", one all-gather per TP-sharded Muon parameter
  the rank steps (every one under ZeRO-0), of its shard cast to the NS dtype (bf16, 2 bytes):
  payload 2·S_tp, bus (tp-1)·2·S_tp, the (tp-1)/tp of each whole matrix a ring receives;
- ZeRO-3 (fsdp_whole_matrix.py): kind "gather_whole", two all-gathers per Muon parameter (its
  gradient and its weight, FSDP2's rows of each, fp32): payload 2·4·S/N, bus 2·4·S·(N-1)/N;
  then "broadcast_dp", the whole parameter from its owner: 4·S.

Counted exactly: the byte counts are integers of the shapes, so any other collective, dtype
or repeat shows.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_ranks
from tests.parallel import encoder_model as enc

KINDS = ("broadcast_dp", "muon_tp_gather", "gather_whole")


def one_step(rank: int, world: int, tp: int, zero_stage: int) -> dict:
    """One muon step through build_data_parallel; comm stats of KINDS during the step, and
    this rank's Muon parameters as (numel, TP-sharded)."""
    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.parallel.data_parallel import build_data_parallel
    from megatron_lite.parallel.params import meta_of

    mesh, model = enc._setup(world, tp=tp)
    # Muon's: every matrix but the word embedding (module docstring), read before FSDP2
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "embedding.weight"]
    muon = [(p.numel(), meta_of(p).tp_dim is not None and tp > 1) for p in matrices]
    dp = build_data_parallel([model], mesh, zero_stage=zero_stage, optimizer="muon", lr=1e-3,
                             layers_of=lambda chunk: chunk.blocks)  # fmt: skip
    dp.start_step(enc.GLOBAL_BATCH // (mesh.dp.size * enc.MICRO))
    enc._loss_sum(mesh, model, dp.before_backward)
    dp.finish_grad_sync()
    STATS.start_step(1)  # the optimizer step's collectives alone
    dp.step()
    dp.wait_params()
    return {
        "muon": muon,
        "bytes": {k: STATS.bytes.get(k, 0) for k in KINDS},
        "bus": {k: STATS.bus_bytes.get(k, 0.0) for k in KINDS},
        "calls": {k: STATS.calls.get(k, 0) for k in KINDS},
    }


def published(muon: list[tuple[int, bool]], tp: int, dp: int, zero_stage: int) -> dict:
    """{kind: (payload bytes, bus bytes, calls)} of one step from the module docstring's
    counts; muon: (elements on this rank, TP-sharded) of each Muon parameter (ZeRO-0 and
    ZeRO-3's gathers: each rank takes part for every parameter)."""
    s = sum(n for n, _ in muon)
    sharded = [n for n, is_tp in muon if is_tp]
    out = dict.fromkeys(KINDS, (0, 0.0, 0))
    if zero_stage in (1, 2) and dp > 1:
        out["broadcast_dp"] = (4 * s, 4.0 * s, len(muon))
    if tp > 1:
        out["muon_tp_gather"] = (2 * sum(sharded), (tp - 1) * 2.0 * sum(sharded), len(sharded))
    if zero_stage == 3 and dp > 1:
        out["gather_whole"] = (2 * 4 * s // dp, 2 * 4.0 * s * (dp - 1) / dp, 2 * len(muon))
        out["broadcast_dp"] = (4 * s, 4.0 * s, len(muon))
    return out


# (world, tp, zero stage): ZeRO-1 dp2, tp2 ZeRO-0, ZeRO-3 dp2
CASES = {"zero1-dp2": (2, 1, 1), "tp2-zero0": (2, 2, 0), "zero3-dp2": (2, 1, 3)}


# ZeRO-1's broadcasts in the suite; the TP gathers and ZeRO-3's in the slow tier (the suite's
# budget; test_plan_muon.py holds the planner's TP gathers to a real step's in the slow tier too)
@pytest.mark.parametrize(
    "case", [c if c == "zero1-dp2" else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_muon_step_moves_the_published_bytes(case):
    world, tp, zero_stage = CASES[case]
    dp = world // tp
    for rank, got in enumerate(run_ranks(world, one_step, tp, zero_stage, timeout=120)):
        want = published(got["muon"], tp, dp, zero_stage)
        for kind in KINDS:
            have = (got["bytes"][kind], got["bus"][kind], got["calls"][kind])
            assert have == want[kind], (
                f"{case} rank {rank} {kind}: (payload, bus bytes, calls) recorded {have}, "
                f"published {want[kind]}"
            )
