"""The MoE layer under a dry run (plan --dry-run): fake tensors (shapes, no data) and torch's
fake process group, EP rank 1 of 2. Routing cannot be read there, so the dispatcher must size
the all-to-all and the expert blocks by balanced routing: with T tokens, top-k and E experts,
every expert gets T·k/E assignments (the first T·k mod E experts one more), at most the shard's
capacity. Real runs read the counts instead (tests/parallel/test_moe.py checks their shapes)."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_lite.moe import MoELayer, moe_metrics
from megatron_lite.parallel.fake import FakeTensorMode

E, K, H, FFN = 4, 2, 16, 8

# name: (tokens on this rank, capacity factor, what EP rank 1 of 2 must see under balanced routing:
#   rows sent to EP ranks 0 and 1, rows received from them, rows per local expert (2 and 3))
CASES = {
    # 7·2 = 14 assignments over 4 experts: [4, 4, 3, 3]; rank 1 owns experts 2 and 3
    "dropless": (7, None, [8, 6], [6, 6], [6, 6]),
    # capacity ceil(0.5 · 8·2/4) = 2 of the balanced 4 per expert: 8 of 16 assignments kept
    "capacity": (8, 0.5, [4, 4], [4, 4], [4, 4]),
}


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES)
def test_dispatch_sizes_are_balanced_under_fake_tensors(fake_world, case):
    T, factor, send, recv, per_local = CASES[case]
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = MoELayer(
            H,
            FFN,
            E,
            K,
            ep_group=fake_world,
            aux_loss_coeff=0.01,
            z_loss_coeff=0.001,
            capacity_factor=factor,
        )
        seen = []
        dispatch = layer.dispatcher.dispatch

        def recording(*args, **kwargs):
            expert_in, counts, handle = dispatch(*args, **kwargs)
            seen.append((expert_in.shape, counts, handle.send_splits, handle.recv_splits))
            return expert_in, counts, handle

        layer.dispatcher.dispatch = recording
        x = torch.randn(T, 1, H, requires_grad=True)  # [s, b, h]
        out = layer(x)
        out.sum().backward()
        metrics = moe_metrics([layer], 1, E, count_here=True, with_z_loss=True, group=fake_world)

    (shape, counts, sent, received), *_ = seen
    assert (sent, received) == (send, recv), f"{case}: all-to-all splits (sent, received)"
    assert counts == per_local, f"{case}: tokens per local expert {counts}, want {per_local}"
    assert tuple(shape) == (sum(per_local), H), f"{case}: dispatched tokens {tuple(shape)}"
    assert out.shape == x.shape and x.grad.shape == x.shape
    assert layer.experts.weight1.grad.shape == layer.experts.weight1.shape
    assert metrics["aux_loss"] == 1.0, "balanced routing, uniform probabilities"
    balanced = [4, 3] if factor is None else [4, 4]  # over the whole microbatch, before dropping
    assert [metrics["tokens_per_expert_max"], metrics["tokens_per_expert_min"]] == balanced
    assert metrics["dropped_tokens"] == (0 if factor is None else 8)
    assert 0 < metrics["z_loss"] < float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_run_under_fake_tensors(dtype):
    """torch's meta kernel of the grouped GEMM takes bf16 only: fp32 runs the shapes-only
    stand-in, bf16 the native op; both give the loop's shapes and gradient shapes, with
    h and ffn multiples of 16 bytes (as every full-size model) and 3 tokens of 4 experts empty."""
    from megatron_lite.moe import LocalExperts

    shapes = []
    for grouped in (True, False):
        ex = LocalExperts(4, 32, 48, grouped_gemm=grouped).to(dtype)  # real weights
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(10, 32, dtype=dtype, requires_grad=True)
            out = ex(x, [0, 6, 4, 0])
            out.sum().backward()  # an expanded (zero-stride) output gradient
            shapes.append((out.shape, out.dtype, x.grad.shape, ex.weight1.grad.shape))
    assert shapes[0] == shapes[1], f"grouped {shapes[0]} vs loop {shapes[1]}"
