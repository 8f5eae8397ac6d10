"""Activation recomputation repeats the forward bit for bit: fp32 losses, gradient norms and MoE
statistics with recompute equal those without it exactly, with hidden and attention dropout on,
for selective and full (uniform and block) recompute on tp2+SP×pp2, cp2, MoE ep2 and ZeRO-3.

Dropout masks depend on the layout, so each case's reference is the same layout without
recompute (one run per layout, shared by its cases)."""

import functools
import tempfile

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset

DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.steps=3"]
MOE = ["model.num_experts=4", "model.moe_aux_loss_coeff=0.01", "model.moe_ffn_hidden_size=64"]
LAYOUTS = {
    "tp2_sp_pp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"]),
    "cp2": (2, ["parallel.cp=2"]),
    "moe_ep2": (2, [*MOE, "parallel.ep=2"]),
    "zero3": (2, ["parallel.zero_stage=3"]),
}
SELECTIVE = ["model.recompute_granularity=selective"]
FULL = ["model.recompute_granularity=full"]
CASES = {
    "tp2_sp_pp2-selective": ("tp2_sp_pp2", [*SELECTIVE, "model.recompute_modules=[core_attn,mlp]"]),
    "tp2_sp_pp2-uniform": ("tp2_sp_pp2", [*FULL, "model.recompute_method=uniform",
                                          "model.recompute_num_layers=2"]),
    "tp2_sp_pp2-block": ("tp2_sp_pp2", [*FULL, "model.recompute_method=block",
                                        "model.recompute_num_layers=1"]),
    "cp2-selective": ("cp2", SELECTIVE),
    "cp2-uniform": ("cp2", [*FULL, "model.recompute_method=uniform",
                            "model.recompute_num_layers=1"]),
    "moe_ep2-selective": ("moe_ep2", [*SELECTIVE, "model.recompute_modules=[core_attn,moe]"]),
    "moe_ep2-block": ("moe_ep2", [*FULL, "model.recompute_method=block",
                                  "model.recompute_num_layers=3"]),
    "zero3-uniform": ("zero3", [*FULL, "model.recompute_method=uniform",
                                "model.recompute_num_layers=2"]),
}  # fmt: skip
# everything a step reports that the forward and backward decide (not times or comm volume)
EXACT = ("loss", "grad_norm", "aux_loss", "tokens_per_expert_min", "tokens_per_expert_max")


def _train(rank, world, overrides, out_dir):
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    records = Trainer(cfg, mesh, dataset, vocab).train()
    if dist.get_rank() != 0:
        return None
    return [{k: r[k] for k in EXACT if k in r} for r in records]


def run(layout: str, extra: tuple[str, ...]) -> list[dict]:
    world, overrides = LAYOUTS[layout]
    data = f"data.paths=[{structured_dataset()}]"
    with tempfile.TemporaryDirectory() as tmp:
        args = [*TINY, data, *DROPOUT, *overrides, *extra]
        return run_ranks(world, _train, args, tmp, timeout=120)[0]


@functools.cache
def reference(layout: str) -> list[dict]:
    return run(layout, ())


@pytest.mark.parametrize("case", CASES)
def test_recompute_is_bitwise_exact(case):
    layout, extra = CASES[case]
    ref, got = reference(layout), run(layout, tuple(extra))
    assert len(ref) == 3 and ref[0]["loss"] > 0
    assert got == ref, f"{case}: recompute changed the run\nwith:    {got}\nwithout: {ref}"
