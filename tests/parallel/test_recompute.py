"""Activation recomputation repeats the forward bit for bit: fp32 losses, gradient norms and MoE
statistics with recompute equal those without it exactly, with hidden and attention dropout on,
for selective and full (uniform and block) recompute on tp2+SP×pp2, cp2, MoE ep2 and ZeRO-3.

Dropout masks depend on the layout, so each case's reference is the same layout without
recompute (one run per layout, shared by its cases)."""

import functools
import tempfile

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset, train_records

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


def run(layout: str, extra: tuple[str, ...]) -> list[dict]:
    world, overrides = LAYOUTS[layout]
    return train_records(world, [*DROPOUT, *overrides, *extra], EXACT, timeout=120)


@functools.cache
def reference(layout: str) -> list[dict]:
    return run(layout, ())


@pytest.mark.parametrize("case", CASES)
def test_recompute_is_bitwise_exact(case):
    layout, extra = CASES[case]
    ref, got = reference(layout), run(layout, tuple(extra))
    assert len(ref) == 3 and ref[0]["loss"] > 0
    assert got == ref, f"{case}: recompute changed the run\nwith:    {got}\nwithout: {ref}"


def _saved_bytes(rank, world, overrides, out_dir):
    """Bytes of the distinct storages autograd keeps for one forward of the whole model (saved
    tensors outside recomputed regions; a recomputed region's own are not kept)."""
    import torch

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    sample = torch.randint(0, 250, (2, 33))
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.chunks[0](sample[:, :-1], sample[:, 1:]).sum()
    loss.backward()
    return sum(kept.values())


def test_recompute_keeps_fewer_activations():
    """Selective recompute drops the attention internals, full recompute nearly everything."""
    modes = {
        "none": [],
        "selective": SELECTIVE,
        "full": [*FULL, "model.recompute_method=uniform", "model.recompute_num_layers=4"],
    }
    data = f"data.paths=[{structured_dataset()}]"
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in modes.items():
            out = f"{tmp}/{mode}"
            got[mode] = run_ranks(1, _saved_bytes, [*TINY, data, *DROPOUT, *extra], out)[0]
    print(f"RECOMPUTE saved bytes per forward: {got}")
    assert got["full"] < got["selective"] < got["none"], got
