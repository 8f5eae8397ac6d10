"""Mixture of experts on several ranks: the all-to-all dispatcher against a dense float64
reference, and loss parity of expert-parallel layouts against a single rank (6 steps, fp32)."""

import functools

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import SHORT, assert_parity, max_rel_diff, train_records

MOE = [
    "model.arch=llama",
    "model.num_experts=4",
    "model.moe_router_topk=2",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_ffn_hidden_size=64",
]
# capacity dropping and the z-loss, on a layout that splits each microbatch's tokens over
# CP and SP ranks (the capacity and the losses are defined over the whole microbatch)
CAPACITY = [
    *MOE,
    "model.moe_capacity_factor=1.0",
    "model.moe_z_loss_coeff=0.001",
    "model.moe_aux_loss_coeff=0.1",
    # a seed whose routing has no near-tie at fp32 rounding: with the default seed's weights
    # one top-k choice flips between layouts, a discrete jump (loss 1.7e-5, aux 1.1e-4)
    "train.seed=99",
]
# DeepSeek-V3's layer shape, tiny: a dense first layer, then fine-grained experts beside a
# shared expert (a dense SwiGLU every token passes, on the dense MLP's TP/SP layout)
SHARED = [
    *MOE,
    "model.num_experts=8",
    "model.moe_router_topk=4",
    "model.moe_ffn_hidden_size=32",
    "model.moe_shared_expert_ffn_hidden_size=48",
    "model.moe_first_k_dense_replace=1",
]
LAYOUTS = {
    "ep2": (2, MOE, ["parallel.ep=2"]),
    "ep4": (4, MOE, ["parallel.ep=4"]),
    "ep2_tp2_sp": (4, MOE, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep2_pp2": (4, MOE, ["parallel.ep=2", "parallel.pp=2"]),
    "capacity_cp2_tp2_sp_ep2": (
        4,
        CAPACITY,
        ["parallel.cp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
    ),
    "shared_ep2_pp2": (4, SHARED, ["parallel.ep=2", "parallel.pp=2"]),
    # the shared expert on the dense MLP's TP/SP layout (its all-gather and reduce-scatter
    # included) beside the dispatch all-to-all
    "shared_overlap_ep2_tp2_sp": (
        4,
        SHARED,
        [
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "model.moe_shared_expert_overlap=true",
        ],
    ),
    "shared_ep4_zero1": (4, SHARED, ["parallel.ep=4", "parallel.zero_stage=1"]),
    "shared_ep2_zero3": (2, SHARED, ["parallel.ep=2", "parallel.zero_stage=3"]),
}
METRICS = (
    "loss",
    "grad_norm",
    "aux_loss",
    "tokens_per_expert_min",
    "tokens_per_expert_max",
    "dropped_tokens",
)


def moe_records(world: int, overrides: list[str]) -> list[dict]:
    return train_records(world, overrides, METRICS)


@functools.cache
def reference_records(overrides: tuple[str, ...]) -> list[dict]:
    """One rank, ep=1: all experts local (cached per model config)."""
    return moe_records(1, list(overrides))


@pytest.mark.parity
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_loss_parity(layout):
    world, model, parallel = LAYOUTS[layout]
    model = [*model, *SHORT]
    ref = reference_records(tuple(model))
    got = moe_records(world, model + parallel)
    ref_losses = [r["loss"] for r in ref]
    assert ref_losses[-1] < ref_losses[0] - 0.1, f"reference loss did not fall: {ref_losses}"
    assert_parity(got, ref, f"moe {layout}")
    aux_diff = max_rel_diff([r["aux_loss"] for r in got], [r["aux_loss"] for r in ref])
    print(f"PARITY moe {layout}: aux loss {aux_diff:.2e}")
    assert aux_diff < 1e-4, f"{layout}: aux loss differs by {aux_diff:.2e} (relative)"
    for key in ("tokens_per_expert_min", "tokens_per_expert_max", "dropped_tokens"):
        # counts are integers; allow a near-tie top-k decision flipped by float rounding
        worst = max(abs(a[key] - b[key]) for a, b in zip(got, ref, strict=True))
        assert worst <= 2, f"{layout}: {key} differs by up to {worst} from the single rank"
    if "model.moe_capacity_factor=1.0" in model:
        assert min(r["dropped_tokens"] for r in ref) > 0, "capacity test should drop tokens"


# ---------------------------------------------------------------- dispatcher vs dense reference
E, K, H, F_ = 4, 2, 8, 6
TOKENS = (5, 11)  # uneven token counts per rank


def _inputs():
    """Every rank's inputs and the full expert weights (float64, seeded, same on all ranks)."""
    import torch

    g = torch.Generator().manual_seed(0)
    w1, w2 = (
        torch.randn(E, 2 * F_, H, generator=g, dtype=torch.float64),
        torch.randn(E, H, F_, generator=g, dtype=torch.float64),
    )
    per_rank = []
    for T in TOKENS:
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]  # K distinct experts per token
        weights = torch.rand(T, K, generator=g, dtype=torch.float64)
        keep = torch.rand(T, K, generator=g) > 0.25  # some assignments dropped
        grad_out = torch.randn(T, H, generator=g, dtype=torch.float64)
        per_rank.append((x, idx, weights, keep, grad_out))
    return w1, w2, per_rank


def _dispatch(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_lite.moe import AllToAllTokenDispatcher, LocalExperts

    w1, w2, per_rank = _inputs()
    x, idx, weights, keep, grad_out = per_rank[rank]
    experts = LocalExperts(E, H, F_, ep_rank=rank, ep_size=world).double()
    with torch.no_grad():
        experts.weight1.copy_(w1.chunk(world)[rank])
        experts.weight2.copy_(w2.chunk(world)[rank])
    x, weights = x.requires_grad_(True), weights.requires_grad_(True)
    dispatcher = AllToAllTokenDispatcher(E, dist.group.WORLD)
    expert_in, counts, handle = dispatcher.dispatch(x, idx, weights, keep)
    out = dispatcher.combine(experts(expert_in, counts), handle)
    (out * grad_out).sum().backward()
    # plain lists: tensors sent through the result queue would outlive their sender's memory
    tensors = (out.detach(), x.grad, weights.grad, experts.weight1.grad, experts.weight2.grad)
    return [t.tolist() for t in tensors], counts, expert_in.shape[0]


def _dense_reference():
    """Every expert on every token, weighted by the (kept) router weight, summed."""
    import torch
    import torch.nn.functional as F

    w1, w2, per_rank = _inputs()
    w1, w2 = w1.requires_grad_(True), w2.requires_grad_(True)
    results = []
    for x, idx, weights, keep, grad_out in per_rank:
        x, weights = x.requires_grad_(True), weights.requires_grad_(True)
        gate, up = torch.einsum("th,efh->etf", x, w1).chunk(2, dim=-1)  # [E, T, ffn]
        y = torch.einsum("etf,ehf->eth", F.silu(gate) * up, w2)  # [E, T, h]
        dense_w = torch.zeros(x.shape[0], E, dtype=torch.float64).scatter(
            1, idx, weights * keep
        )  # [T, E]
        out = torch.einsum("te,eth->th", dense_w, y)
        (out * grad_out).sum().backward()
        results.append((out.detach(), x.grad, weights.grad))
    return results, w1.grad, w2.grad


def test_dispatcher_matches_dense_reference_float64():
    got = run_ranks(2, _dispatch, timeout=60)
    ref, w1_grad, w2_grad = _dense_reference()
    import torch

    per_rank = _inputs()[2]
    for rank, (lists, counts, rows) in enumerate(got):
        # a real run sizes each expert's block by the kept assignments routed to it (all ranks)
        local = range(rank * E // 2, (rank + 1) * E // 2)
        want = [sum(int((i[k] == e).sum()) for _, i, _, k, _ in per_rank) for e in local]
        assert counts == want and rows == sum(want), f"rank {rank}: {counts}, {rows} != {want}"
        out, x_grad, w_grad, g1, g2 = (torch.tensor(v, dtype=torch.float64) for v in lists)
        r_out, r_x, r_w = ref[rank]
        for name, a, b in (
            ("output", out, r_out),
            ("input grad", x_grad, r_x),
            ("router weight grad", w_grad, r_w),
            ("expert weight1 grad", g1, w1_grad.chunk(2)[rank]),
            ("expert weight2 grad", g2, w2_grad.chunk(2)[rank]),
        ):
            torch.testing.assert_close(
                a, b, rtol=1e-10, atol=1e-12, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
