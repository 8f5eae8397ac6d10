"""Activation CPU offload in the trainer (model.activation_offload): losses and gradient norms
bit for bit those without it (1 rank; tp2+SP, pp2 1F1B, dp2 ZeRO-3, selective recompute, cp2,
MoE ep2), and the bytes each step moves to the host (offload/bytes) equal
to an independent count: plain saved-tensor hooks around the same submodules in a run without
offload (weights, smaller tensors and recomputed regions left out, and the chunk's last layer
when its backward follows its forward at once: every microbatch without pipelining and on
1F1B's last stage, none on its first stage)."""

import tempfile

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset

ALL_DENSE = "model.activation_offload=[attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,mlp]"
MIN_BYTES = "model.activation_offload_min_bytes=1024"  # TINY's per-layer tensors are 4-16 KiB
BASE = ["train.steps=2", MIN_BYTES]


def _run(rank, world, overrides, out_dir, count_names, skip_last):
    """Train; rank 0 returns (loss, grad_norm, offload/bytes) per step and the independent
    count of bytes (count_names: the parts to count in this run, which has no offload)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from megatron_lite.parallel import recompute
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)
    min_bytes, total, seen = cfg.model.activation_offload_min_bytes, [0], set()

    def pack(t):
        param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        skip = param or recompute.in_region() or type(t) is not torch.Tensor
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        nbytes = t.numel() * t.element_size()
        if not skip and nbytes >= min_bytes and key not in seen:
            seen.add(key)
            total[0] += nbytes
        return t

    stack = []

    def pre(*_):
        grad = torch.is_grad_enabled() and not recompute.is_recomputing()
        stack.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if grad else None)
        if stack[-1] is not None:
            stack[-1].__enter__()

    def post(*_):
        hooks = stack.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
        seen.clear()

    for chunk in trainer.chunks if count_names else []:
        layers = list(chunk.layers.values())
        for layer in layers[:-1] if skip_last else layers:
            for name, m in layer.offload_parts().items():
                if name in count_names:
                    m.register_forward_pre_hook(pre)
                    m.register_forward_hook(post)
    records = trainer.train()
    if dist.get_rank() != 0:
        return None
    keys = ("loss", "grad_norm", "offload/bytes")
    return [tuple(r.get(k) for k in keys) for r in records], total[0]


def offload_vs_count(world, layout, names, skip_last, timeout=240):
    """(records with offload, records without, the count of the run without)."""
    data = f"data.paths=[{structured_dataset()}]"
    args = [*TINY, data, *BASE, *layout]
    offload = f"model.activation_offload=[{','.join(names)}]"
    with tempfile.TemporaryDirectory() as tmp:
        got, _ = run_ranks(world, _run, [*args, offload], tmp, (), skip_last, timeout=timeout)[0]
    with tempfile.TemporaryDirectory() as tmp:
        ref, count = run_ranks(world, _run, args, tmp, names, skip_last, timeout=timeout)[0]
    return got, ref, count


DENSE = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp"]


def check(got, ref, count, label):
    assert [r[:2] for r in got] == [r[:2] for r in ref], f"{label}: offload changed the run"
    moved = sum(r[2] for r in got)
    assert count > 0 and moved == count, f"{label}: offloaded {moved} B, counted {count} B"


@pytest.mark.slow  # two 2-step runs: ~8 s of wall time on 2 idle cores
@pytest.mark.parity
def test_offload_one_rank_is_bitwise_and_moves_the_counted_bytes():
    got, ref, count = offload_vs_count(1, [], DENSE, skip_last=True)
    check(got, ref, count, "1 rank")
    # the planner's figure (one layer measured on fake tensors) to the byte: 4 microbatches of
    # 4 layers, each microbatch's last layer kept (no pipelining: its backward is next)
    from megatron_lite.config import load_config
    from megatron_lite.plan.activation_offload import layer_offload_bytes, stage_offload
    from megatron_lite.validation import validate

    cfg = validate(load_config(None, [*TINY, *BASE, ALL_DENSE, "data.mock=true"]), 1, warn=False)
    b = layer_offload_bytes(cfg, kernels="torch")  # a CPU run uses the torch kernels
    assert got[0][2] == 12 * b, (got, b)
    plan = stage_offload(cfg, 0, layer_forward_s=1e-3, host_gbps=25.0, kernels="torch")
    assert plan.host_peak_bytes == 3 * b  # one microbatch's first 3 layers
    assert plan.pcie_bytes_per_step == 2 * got[0][2]


LAYOUTS = {
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], True),
    # rank 0 is 1F1B's first stage: no forward has its backward next, every layer offloads
    "pp2_1f1b": (2, ["parallel.pp=2"], False),
    "dp2_zero3": (2, ["parallel.zero_stage=3"], True),
    "selective_recompute": (
        1,
        ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"],
        True,
    ),
    "cp2": (2, ["parallel.cp=2"], True),
    "moe_ep2": (
        2,
        ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "parallel.ep=2"],
        True,
    ),
}
MOE_NAMES = ["attn_norm", "core_attn", "attn_proj", "moe_experts"]


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_layouts_are_bitwise_and_move_the_counted_bytes(layout):
    world, overrides, skip_last = LAYOUTS[layout]
    names = MOE_NAMES if layout.startswith("moe") else DENSE
    got, ref, count = offload_vs_count(world, overrides, names, skip_last)
    check(got, ref, count, layout)
