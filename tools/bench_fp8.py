"""FP8 vs bf16 GEMMs: error and time of one linear's three GEMMs (forward, dgrad, wgrad) through
parallel/fp8.py (torchao's tensorwise and rowwise recipes) against the bf16 GEMMs, on random
inputs at a transformer-like shape, one rank.

    python tools/bench_fp8.py [--tokens 2048] [--in 1024] [--out 4096] [--reps 3]

Error: relative Frobenius error ‖y − y_exact‖/‖y_exact‖ against the float64 product of the same
bf16 inputs (bf16's own error is printed beside it). Time: the median over --reps of the three
GEMMs (casts and scales included). On a CPU the FP8 GEMM is not faster (torch._scaled_mm has no
FP8 hardware there): the target on CPU is the error; the speed is a GPU figure
(tools/gpu_check.sh's train/fp8_* items). `fp8_gemm_figures()` returns the rows, for
tools/bench_compile.py or any other caller.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _timed(fn, reps: int) -> tuple[float, tuple]:
    out = fn()  # warm-up (torchao's import, first-call dispatch)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def _rel(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.double() - exact).norm() / exact.norm())


def fp8_gemm_figures(
    tokens: int = 2048, d_in: int = 1024, d_out: int = 4096, reps: int = 3
) -> list[dict]:
    """One row per path (bf16, tensorwise, rowwise): the three GEMMs' relative errors against
    float64 and their median time in ms. x [tokens, in], W [out, in], g [tokens, out]."""
    from megatron_lite.parallel.fp8 import Fp8Gemm

    torch.manual_seed(0)
    x = torch.randn(tokens, d_in).bfloat16()
    w = (torch.randn(d_out, d_in) * d_in**-0.5).bfloat16()
    g = (torch.randn(tokens, d_out) * 1e-3).bfloat16()
    exact = (x.double() @ w.double().t(), g.double() @ w.double(), g.double().t() @ x.double())
    paths = {"bf16": lambda: (x @ w.t(), g @ w, g.t() @ x)}
    for recipe in ("tensorwise", "rowwise"):
        gemm = Fp8Gemm(recipe)
        paths[recipe] = lambda gemm=gemm: (gemm.forward(x, w), gemm.dgrad(g, w), gemm.wgrad(g, x))
    rows = []
    for name, fn in paths.items():
        ms, outs = _timed(fn, reps)
        errs = [_rel(y, e) for y, e in zip(outs, exact, strict=True)]
        rows.append(dict(path=name, forward=errs[0], dgrad=errs[1], wgrad=errs[2], ms=ms))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--in", dest="d_in", type=int, default=1024)
    ap.add_argument("--out", dest="d_out", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = fp8_gemm_figures(a.tokens, a.d_in, a.d_out, a.reps)
    print(f"GEMMs of x [{a.tokens}, {a.d_in}] · W [{a.d_out}, {a.d_in}]ᵀ, one CPU thread")
    print(f"{'path':<11} {'fwd err':>9} {'dgrad err':>9} {'wgrad err':>9} {'3 GEMMs ms':>11}")
    for r in rows:
        print(
            f"{r['path']:<11} {r['forward']:>9.2e} {r['dgrad']:>9.2e} {r['wgrad']:>9.2e} "
            f"{r['ms']:>11.1f}"
        )
    base = rows[0]["ms"]
    print("time vs bf16: " + ", ".join(f"{r['path']} {r['ms'] / base:.2f}x" for r in rows[1:]))


if __name__ == "__main__":
    main()
