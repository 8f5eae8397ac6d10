"""Grouped-GEMM experts (moe/experts.py) against the per-expert loop and a plain per-group
matmul, on balanced, skewed and empty routing, fp32, float64 and bf16; and the no-Python-loop
property: the aten ops one MoE layer dispatches in forward+backward do not grow with E."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.moe import LocalExperts, MoELayer
from megatron_lite.moe.experts import expert_offsets, grouped_mm, native_grouped_mm
from tests.dist_harness import run_ranks

H, FFN = 32, 48
ROUTINGS = {  # rows per expert (E = 4)
    "balanced": [5, 5, 5, 5],
    "skewed": [17, 1, 0, 2],
    "all_to_one": [0, 0, 20, 0],
    "first_empty": [0, 7, 6, 7],
}


def _reference_mm(x, w, counts):
    """Each group's rows times its matrix, one plain matmul per group (the definition)."""
    return torch.cat([xg @ w[g] for g, xg in enumerate(x.split(counts))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b", [48, 6])  # 48: torch._grouped_mm in fp32; 6: unaligned rows
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_mm_matches_per_group_matmul(routing, b, dtype):
    counts = ROUTINGS[routing]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), b, H, generator=g, dtype=dtype).requires_grad_(True)
    dy = torch.randn(sum(counts), b, generator=g, dtype=dtype)
    native = native_grouped_mm(x, w.transpose(1, 2))
    assert native == (dtype == torch.float32 and b % 4 == 0), "which path runs"
    got = grouped_mm(x, w.transpose(1, 2), expert_offsets(counts, x.device))
    got_grads = torch.autograd.grad(got, (x, w), dy)
    want = _reference_mm(x, w.transpose(1, 2), counts)
    want_grads = torch.autograd.grad(want, (x, w), dy)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    for name, a, r in zip(("out", "dx", "dw"), (got, *got_grads), (want, *want_grads), strict=True):
        torch.testing.assert_close(a, r, **tol, msg=lambda m, n=name: f"{routing} {n}: {m}")


def test_offsets_from_a_tensor_equal_from_a_list():
    counts = [3, 0, 9, 1]
    from_list = expert_offsets(counts, torch.device("cpu"))
    from_tensor = expert_offsets(torch.tensor(counts), torch.device("cpu"))
    assert from_list.dtype == from_tensor.dtype == torch.int32
    assert from_list.tolist() == from_tensor.tolist() == [3, 3, 12, 13]


def _experts(grouped: bool, gated: bool, dtype, ffn: int = FFN) -> LocalExperts:
    torch.manual_seed(0)
    ex = LocalExperts(4, H, ffn, gated=gated, grouped_gemm=grouped)
    with torch.no_grad():
        ex.weight1.normal_(0, 0.2)
        ex.weight2.normal_(0, 0.2)
    return ex.to(dtype)


def _run(ex: LocalExperts, x: torch.Tensor, counts, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    out = ex(x, counts)
    out.backward(dy)
    return out.detach(), x.grad, ex.weight1.grad, ex.weight2.grad


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ffn", [FFN, 6])  # 6: the block-sparse path in fp32 too
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_experts_match_the_loop(routing, ffn, dtype, gated):
    """Output and every gradient. fp32 with torch._grouped_mm (ffn 48): ≤ 1e-6 (bitwise on
    this CPU, another BLAS may sum in another order); the block-sparse path sums in another
    order than the loop's matmuls: fp32 ≤ 1e-5, float64 ≤ 1e-12."""
    counts = ROUTINGS[routing]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), H, generator=g, dtype=dtype)
    dy = torch.randn(sum(counts), H, generator=g, dtype=dtype)
    got = _run(_experts(True, gated, dtype, ffn), x, counts, dy)
    want = _run(_experts(False, gated, dtype, ffn), x, counts, dy)
    fp32 = 1e-6 if ffn % 4 == 0 else 1e-5
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=fp32, atol=fp32)
    for name, a, r in zip(
        ("out", "x grad", "weight1 grad", "weight2 grad"), got, want, strict=True
    ):
        torch.testing.assert_close(a, r, **tol, msg=lambda m, n=name: f"{routing} {n}: {m}")


def test_grouped_experts_take_an_expanded_output_gradient():
    """`.sum().backward()` hands the experts a zero-stride gradient, which torch._grouped_mm's
    own backward rejects: the same gradients as the loop."""
    counts = ROUTINGS["skewed"]
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(4))
    grads = []
    for grouped in (True, False):
        ex = _experts(grouped, True, torch.float32)
        xi = x.clone().requires_grad_(True)
        ex(xi, counts).sum().backward()
        grads.append((xi.grad, ex.weight1.grad, ex.weight2.grad))
    for name, a, r in zip(("x", "weight1", "weight2"), *grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_grouped_experts_bf16_close_to_fp32(routing):
    """bf16 weights and input (as train.precision=bf16) against the loop in fp32 on the same
    (rounded) values: bf16 rounding of the products, 2^-8 relative each, bounds it."""
    counts = ROUTINGS[routing]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), H, generator=g).bfloat16()
    dy = torch.randn(sum(counts), H, generator=g).bfloat16()
    ex16 = _experts(True, True, torch.bfloat16)
    assert native_grouped_mm(x, ex16.weight1.transpose(1, 2)), "bf16 runs torch._grouped_mm"
    got = _run(ex16, x, counts, dy)
    ex32 = _experts(False, True, torch.float32)
    with torch.no_grad():  # the same bf16 values, upcast
        ex32.weight1.copy_(ex16.weight1.float())
        ex32.weight2.copy_(ex16.weight2.float())
    want = _run(ex32, x.float(), counts, dy.float())
    for name, a, r in zip(
        ("out", "x grad", "weight1 grad", "weight2 grad"), got, want, strict=True
    ):
        assert a.dtype == torch.bfloat16, f"{name} is {a.dtype}"
        err = (a.float() - r).norm() / r.norm()
        assert err < 1e-2, f"{routing} bf16 {name}: relative error {err:.2e}"


# ---------------------------------------------------------------- the no-Python-loop property
class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _layer_ops(num_experts: int, topk: int, grouped: bool, ep_group=None, seed: int = 0) -> int:
    """aten ops one MoE layer (router, dispatch, experts, combine) dispatches in forward and
    backward on 64 tokens, h=32, SwiGLU experts of width 16."""
    torch.manual_seed(seed)
    layer = MoELayer(
        32, 16, num_experts, topk, ep_group=ep_group, aux_loss_coeff=0.01, grouped_gemm=grouped
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    x = torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    with _OpCounter() as counter:
        out = layer(x)
        out.backward(torch.ones_like(out))
    return counter.count


def test_ops_per_layer_do_not_grow_with_experts():
    """Same tokens and top-k, E = 8, 64, 256 (most experts empty at 256): the grouped path
    dispatches the same number of ops; the loop's grows by several per expert (so this test
    sees a loop)."""
    grouped = {E: _layer_ops(E, 2, True) for E in (8, 64, 256)}
    loop = {E: _layer_ops(E, 2, False) for E in (8, 64)}
    print(f"ops per MoE layer fwd+bwd: grouped {grouped}, loop {loop}")
    assert len(set(grouped.values())) == 1, f"grouped ops grow with E: {grouped}"
    assert loop[64] - loop[8] >= 3 * 56, f"the loop's count should grow with E: {loop}"


def _ep2_ops(rank, world):
    import torch.distributed as dist

    return {E: _layer_ops(E, 2, True, dist.group.WORLD, seed=rank) for E in (8, 64, 256)}


def test_ops_per_layer_do_not_grow_with_experts_ep2():
    """The same on 2 ranks, ep=2 (counts all-to-all, uneven token all-to-alls, regrouping)."""
    for rank, ops in enumerate(run_ranks(2, _ep2_ops, timeout=60)):
        print(f"rank {rank} ops per MoE layer fwd+bwd (grouped, ep=2): {ops}")
        assert len(set(ops.values())) == 1, f"rank {rank}: ops grow with E: {ops}"


# ---------------------------------------------------------------- training: grouped vs the loop
MOE = [
    "model.arch=llama",
    "model.num_experts=4",
    "model.moe_router_topk=2",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_ffn_hidden_size=64",
    "train.steps=4",
]


@pytest.mark.parametrize(
    "world, layout, tol",
    [
        (1, [], 1e-6),
        (2, ["parallel.ep=2"], 1e-6),
        (2, ["parallel.ep=2", "train.precision=bf16"], 1e-2),
    ],
)
def test_training_with_grouped_experts_matches_the_loop(world, layout, tol):
    """The tiny MoE model (h 64, 4 experts of ffn 64) trained 4 steps with grouped experts and
    with the loop, same seed and layout: every loss and gradient norm within 1e-6 (relative) in
    fp32; in bf16 (bf16 weights, fp32 main_grad in the gradient buffer) within 1e-2, the two
    summing bf16 products in different orders."""
    from tests.parallel.parity import max_rel_diff, train_records

    keys = ("loss", "grad_norm", "aux_loss", "tokens_per_expert_max")
    grouped = train_records(world, [*MOE, *layout], keys)
    loop = train_records(world, [*MOE, *layout, "model.moe_grouped_gemm=false"], keys)
    for key in ("loss", "grad_norm", "aux_loss"):
        diff = max_rel_diff([r[key] for r in grouped], [r[key] for r in loop])
        print(f"grouped vs loop, world {world}, {key}: {diff:.1e}")
        assert diff <= tol, f"world {world} {layout}: {key} differs by {diff:.2e} (relative)"
    counts = [
        (r["tokens_per_expert_max"], q["tokens_per_expert_max"])
        for r, q in zip(grouped, loop, strict=True)
    ]
    assert all(a == b for a, b in counts), f"routing differs: {counts}"
