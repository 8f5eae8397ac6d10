"""Local FP8 GEMMs (parallel/fp8.py, torchao's tensorwise and rowwise recipes): each GEMM within
the FP8 rounding bound of the exact product; under tp2+SP with TP-reduced scales the layers
equal one rank's, and without the reduction they do not."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks

pytest.importorskip("torchao.float8")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _element_bound(t: torch.Tensor, fmt: torch.dtype, dim: int | None) -> torch.Tensor:
    """Per-element |q(t) - t| bound of a dynamically scaled cast to `fmt` (scale = max_fp8 /
    amax over `dim`, or the whole tensor): round to nearest gives a relative error of half an
    ulp, 2^-(m+1) for m mantissa bits (E4M3: 2^-4, E5M2: 2^-3), for normal values; below the
    smallest normal 2^emin the spacing is fixed, 2^(emin-m), so the absolute error is at most
    2^(emin-m-1) in scaled units. A power-of-two rounded-down scale only makes it smaller."""
    m, emin = (3, -6) if fmt == E4M3 else (2, -14)
    t = t.double()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = torch.finfo(fmt).max / amax
    return torch.maximum(t.abs() * 2.0 ** -(m + 1), 2.0 ** (emin - m - 1) / scale)


def _gemm_bound(a, b, fa, fb, da, db, y):
    """|a·b computed in FP8 − a·b| ≤ Σ_k (e_a|b| + |a|e_b + e_a e_b) (each term's rounding,
    summed in the worst case over the K-long dot product) + 2^-8|y| (the bf16 output's
    rounding) + K·2^-24 Σ|a||b| (fp32 accumulation)."""
    ea, eb = _element_bound(a, fa, da), _element_bound(b, fb, db)
    aa, ab = a.double().abs(), b.double().abs()
    terms = ea @ ab + aa @ eb + ea @ eb
    return terms + 2.0**-8 * y.double().abs() + a.shape[1] * 2.0**-24 * (aa @ ab)


# recipe -> (x̂, W, g) formats and whether the scales are rowwise (torchao's recipe configs)
RECIPES = {"tensorwise": (E4M3, E4M3, E5M2, False), "rowwise": (E4M3, E4M3, E4M3, True)}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_gemms_within_the_rounding_bound(recipe):
    from megatron_lite.parallel.fp8 import Fp8Gemm

    torch.manual_seed(0)
    T, IN, OUT = 64, 256, 96
    x = torch.randn(T, IN).bfloat16()
    w = (torch.randn(OUT, IN) * 0.02).bfloat16()
    g = (torch.randn(T, OUT) * 1e-3).bfloat16()
    x[0, 0] = 40.0  # an outlier: tensorwise scales put small values near the subnormals
    fx, fw, fg, rows = RECIPES[recipe]
    gemm = Fp8Gemm(recipe)
    cases = {  # name: (fp8 result, a, b, a's format, b's, a's scale dim, b's)
        "forward": (gemm.forward(x, w), x, w.t(), fx, fw, -1, 0),
        "dgrad": (gemm.dgrad(g, w), g, w, fg, fw, -1, 0),
        "wgrad": (gemm.wgrad(g, x), g.t(), x, fg, fx, -1, 0),
    }
    for name, (y, a, b, fa, fb, da, db) in cases.items():
        exact = a.double() @ b.double()
        bound = _gemm_bound(a, b, fa, fb, da if rows else None, db if rows else None, y)
        err = (y.double() - exact).abs()
        assert (err <= bound).all(), f"{recipe} {name}: error exceeds the FP8 bound"
        # FP8 really ran: its error is far above bf16 GEMM's (measured: mean 5-20× bf16's)
        bf16 = (a @ b).double()
        assert err.mean() > 3 * (bf16 - exact).abs().mean(), f"{recipe} {name}: not FP8"


S, B, H, FFN = 32, 2, 64, 128


def _tp_mlp(rank, world, recipe, reduce_scales):
    """fc2(fc1(x)) under tp=world with SP (world=1: one rank), bf16, FP8 GEMMs -> y, dx, and
    the full weight gradients."""
    from megatron_lite.models import fp8
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_lite.parallel.params import shard

    if not reduce_scales:  # the wrong scale: each shard's own amax
        fp8.Fp8Gemm._reduce = lambda self, axes, contraction, axiswise: False
    torch.manual_seed(0)
    x, gout = torch.randn(S, B, H).bfloat16(), torch.randn(S, B, H).bfloat16()
    w1, w2 = torch.randn(FFN, H) * 0.05, torch.randn(H, FFN) * 0.05
    w1[3, 5] = w2[7, 100] = 1.0  # outliers on one shard: the shards' amax differ
    g = dist.group.WORLD if world > 1 else None
    fc1 = ColumnParallelLinear(H, FFN, g, bias=False, sequence_parallel=world > 1)
    fc2 = RowParallelLinear(FFN, H, g, bias=False, sequence_parallel=world > 1)
    fp8.apply_fp8(torch.nn.ModuleList([fc1, fc2]), recipe, [])
    with torch.no_grad():
        fc1.weight.copy_(shard(w1, fc1.weight.meta))
        fc2.weight.copy_(shard(w2, fc2.weight.meta))
    xs = x.chunk(world)[rank].clone().requires_grad_()
    y = fc2(torch.nn.functional.gelu(fc1(xs)))
    y.backward(gout.chunk(world)[rank])
    gathered = []
    for t, dim in ((y, 0), (xs.grad, 0), (fc1.weight.grad, 0), (fc2.weight.grad, 1)):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous()) if world > 1 else parts.__setitem__(0, t)
        gathered.append(torch.cat(parts, dim).detach().float())
    return gathered


def _relative_errors(recipe, reduce_scales):
    (one,) = [_tp_mlp(0, 1, recipe, True)]
    two = run_ranks(2, _tp_mlp, recipe, reduce_scales, timeout=120)[0]
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(two, one, strict=True)]


# Measured relative max errors vs one rank (y, dx, dW1, dW2): reduced scales 0.0044, 0.0061,
# 0, 0 for both recipes (the FP8 operands are bitwise one rank's; y and dx differ by the
# row-parallel partial sums' and the dgrad partials' bf16 rounding before their reduction, an
# ulp of 2^-8 on each of two partials: bound 2^-7). Tensorwise per-shard scales: 0.08, 0.10,
# 0.086, 0.021 (FP8 steps of 2^-4 on many elements). Rowwise per-shard scales measure the same
# as reduced ones here: its scales are powers of two, and a scale changed by a power of two
# maps E4M3 values onto E4M3 values, so only values in the subnormal range can differ.
PARITY = 2.0**-7


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tp2_sp_fp8_matches_one_rank_only_with_tp_reduced_scales(recipe):
    reduced = _relative_errors(recipe, True)
    assert max(reduced) <= PARITY, f"{recipe}: tp2 with reduced scales vs one rank {reduced}"
    if recipe == "tensorwise":  # rowwise: power-of-two scales (see PARITY's comment)
        unreduced = _relative_errors(recipe, False)
        assert max(unreduced) > 4 * PARITY, f"{recipe}: per-shard scales pass {unreduced}"


STEPS = 60
TRAIN = [
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "train.precision=bf16",
    "parallel.tp=2",
    "parallel.sequence_parallel=true",
]


def _losses(rank, world, overrides, out_dir):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    mesh = ParallelMesh(RankLayout(world, tp=cfg.parallel.tp))
    return [r["loss"] for r in Trainer(cfg, mesh, dataset, vocab).train() if "loss" in r]


# three 60-step runs on 2 ranks (minutes on 2 cores): on request only, CI's 30-minute budget
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MEGATRON_LITE_FP8_TRAINING") != "1", reason="MEGATRON_LITE_FP8_TRAINING=1"
)
@pytest.mark.timeout(900)
def test_fp8_training_loss_within_3_percent_of_bf16(tmp_path):
    """The issue's acceptance (100 quickstart steps, last-20 mean within 3% of bf16's; those
    figures are in docs/fp8.md) in small: the tiny model on the structured dataset, tp2+SP,
    every linear but the output layer in FP8. Measured (2026-12-05, 2 shared CPU cores, 637 s
    beside other runs): last-20 means bf16 3.4084, tensorwise 3.3985 (−0.29%), rowwise 3.4058
    (−0.08%)."""
    from tests.parallel.parity import TINY, structured_dataset

    args = [*TINY, f"data.paths=[{structured_dataset()}]", *TRAIN]
    tail = {}
    for fp8 in ("null", "tensorwise", "rowwise"):
        run = [*args, f"model.fp8={fp8}"]
        losses = run_ranks(2, _losses, run, str(tmp_path / fp8), timeout=400)[0]
        assert len(losses) == STEPS, f"{fp8}: {len(losses)} losses"
        tail[fp8] = sum(losses[-20:]) / 20
    print(f"FP8 last-20 mean loss after {STEPS} steps: {tail}")
    for fp8 in ("tensorwise", "rowwise"):
        rel = abs(tail[fp8] - tail["null"]) / tail["null"]
        assert rel <= 0.03, f"{fp8}: last-20 mean {tail[fp8]:.4f} vs bf16 {tail['null']:.4f}"
        assert rel > 0, f"{fp8}: bitwise bf16's losses: the FP8 GEMMs did not run"
