"""Microbenchmark of the fused kernels against torch eager, torch.compile, Liger, TE and apex.

    python tools/bench_kernels.py                       # every op, full sizes, all providers
    python tools/bench_kernels.py --quick --ops rms_norm,cross_entropy --out-dir runs/bench

For each op and shape it times forward and backward, converts the time into achieved GB/s from
the minimum bytes the op must move (read inputs once, write outputs once), and divides that by
the device's copy bandwidth measured in the same run (a large tensor copy: 2 bytes moved per
byte copied). On CUDA it also records the peak extra memory of one forward + backward. Results:
a table on screen, bench_kernels.csv / .json and (with matplotlib) bench_kernels.png.

Baselines: "torch" is eager torch in fp32 math (the kernels' references; for cross-entropy
F.cross_entropy on fp32-upcast logits, as model code without a fused loss does), "compile" the
same under torch.compile. Liger, Transformer Engine and apex run when importable.

Without a GPU it says so and times the torch paths on CPU at reduced sizes (the Triton
interpreter is a correctness tool, not something to time).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# the "triton" provider calls the public API, forced: the kernels as timed, without the
# self-check that automatic dispatch runs first (kernels/selfcheck.py)
os.environ["MEGATRON_LITE_KERNELS"] = "triton"
from megatron_lite import kernels  # noqa: E402

OPS = ("rms_norm", "layer_norm", "rope", "swiglu", "cross_entropy")
PROVIDERS = ("triton", "torch", "compile", "liger", "te", "apex")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Unavailable(Exception):
    """A provider that is not installed or does not implement this op."""


@dataclass
class Case:
    op: str
    label: str  # the shape, for the table
    inputs: tuple  # tensors (those requiring grad get gradients) and constants
    bytes_fwd: int
    bytes_bwd: int


# ----------------------------------------------------------------------------------- shapes
def shapes(op: str, gpu: bool, quick: bool) -> list[tuple]:
    """(tokens, width) per op: hidden for norms/rope, ffn for swiglu, vocab for cross-entropy."""
    if not gpu:  # CPU: small enough that eager torch on two cores finishes in seconds
        return {"swiglu": [(1024, 2816)], "cross_entropy": [(512, 32000)]}.get(op, [(1024, 1024)])
    if quick:  # one shape per op, at the sizes the targets name (hidden 4K, vocab 128K)
        return {"swiglu": [(8192, 14336)], "cross_entropy": [(4096, 128256)]}.get(
            op, [(8192, 4096)]
        )
    widths = {
        "swiglu": (14336, 28672),  # Llama-3 8B / 70B ffn
        "cross_entropy": (32000, 128256),  # Llama-2 / Llama-3 vocabularies
    }.get(op, (4096, 8192))  # hidden of 1B-8B / 70B models
    tokens = (4096, 8192) if op == "cross_entropy" else (4096, 16384)
    return [(t, w) for t in tokens for w in widths]


def make_case(op: str, tokens: int, width: int, dtype, device) -> Case:
    """Fresh inputs and the minimum bytes moved (e = element size; fp32 stats ignored)."""
    e = torch.tensor([], dtype=dtype).element_size()
    rnd = lambda *s, grad=True: torch.randn(*s, device=device, dtype=dtype).requires_grad_(grad)
    n = tokens * width
    if op in ("rms_norm", "layer_norm"):
        ins = (rnd(tokens, width), rnd(width))
        if op == "layer_norm":
            ins = (*ins, rnd(width))
        return Case(op, f"{tokens}x{width}", ins, 2 * n * e, 3 * n * e)  # x,y | x,dy,dx
    if op == "rope":
        d = 128
        x = rnd(tokens, 1, width // d, d)  # [s, b=1, n, d]
        ang = torch.rand(tokens, d, device=device) * 6.28
        ins = (x, ang.cos().to(dtype), ang.sin().to(dtype))
        return Case(op, f"{tokens}x1x{width // d}x{d}", ins, 2 * n * e, 2 * n * e)
    if op == "swiglu":
        return Case(op, f"{tokens}x{width}", (rnd(tokens, width), rnd(tokens, width)),
                    3 * n * e, 5 * n * e)  # fmt: skip
    logits = rnd(tokens, width)
    target = torch.randint(0, width, (tokens,), device=device)
    return Case(op, f"{tokens}x{width}", (logits, target), n * e, 2 * n * e)  # logits | +dlogits


# -------------------------------------------------------------------------------- providers
def _torch_fn(op):
    if op == "cross_entropy":  # what model code does without a fused kernel
        return lambda x, t: F.cross_entropy(x.float(), t, reduction="none")
    return {
        "rms_norm": lambda x, w: kernels.rms_norm_reference(x, w, 1e-6),
        "layer_norm": lambda x, w, b: kernels.layer_norm_reference(x, w, b, 1e-5),
        "rope": kernels.apply_rope_reference,
        "swiglu": kernels.swiglu_reference,
    }[op]


def _liger_fn(op):
    try:
        import liger_kernel.transformers.functional as lf
    except ImportError as e:
        raise Unavailable("liger-kernel not installed") from e
    if op == "rms_norm":
        return lambda x, w: lf.liger_rms_norm(x, w, 1e-6)
    if op == "layer_norm":
        return lambda x, w, b: lf.liger_layer_norm(x, w, b, 1e-5)
    if op == "swiglu":
        return lf.liger_swiglu
    if op == "cross_entropy":
        return lambda x, t: lf.liger_cross_entropy(x, t, reduction="none")
    # rope: Liger takes q, k as [b, n, s, d] with cos/sin [1, s, d]; time it on q only
    return lambda x, c, s: lf.liger_rope(x.permute(1, 2, 0, 3), x.permute(1, 2, 0, 3),
                                         c[None], s[None])[0]  # fmt: skip


def _module_fn(op, case, lib):
    """TE / apex norms are modules: build one with the case's weight, hidden size and dtype."""
    x, w = case.inputs[0], case.inputs[1]
    try:
        if lib == "te":
            import transformer_engine.pytorch as te

            cls = {"rms_norm": te.RMSNorm, "layer_norm": te.LayerNorm}.get(op)
            make = lambda: cls(x.shape[-1], eps=1e-6, params_dtype=x.dtype, device=x.device)
        else:
            from apex.normalization import FusedLayerNorm, FusedRMSNorm

            cls = {"rms_norm": FusedRMSNorm, "layer_norm": FusedLayerNorm}.get(op)
            make = lambda: cls(x.shape[-1], eps=1e-6).to(x.device, x.dtype)
    except ImportError as e:
        raise Unavailable(f"{lib} not installed") from e
    if cls is None:
        raise Unavailable(f"{lib} has no {op} in this benchmark")
    module = make()
    with torch.no_grad():
        module.weight.copy_(w)
    return lambda *ins: module(ins[0]), list(module.parameters())


def provider_fn(provider: str, case: Case):
    """-> (callable on case.inputs, extra leaves that receive gradients)."""
    op = case.op
    if provider == "triton":
        if not case.inputs[0].is_cuda:
            raise Unavailable("needs a GPU")
        return {
            "rms_norm": lambda x, w: kernels.rms_norm(x, w, 1e-6),
            "layer_norm": lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5),
            "rope": kernels.apply_rope,
            "swiglu": kernels.swiglu,
            "cross_entropy": kernels.cross_entropy,
        }[op], []
    if provider == "torch":
        return _torch_fn(op), []
    if provider == "compile":
        return torch.compile(_torch_fn(op), dynamic=False), []
    if provider == "liger":
        return _liger_fn(op), []
    return _module_fn(op, case, provider)


# ---------------------------------------------------------------------------------- timing
def bench_ms(fn, device, args) -> float:
    """Median milliseconds of fn() (CUDA: triton's do_bench, which also flushes L2)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(args.rep_ms // 4, 1), rep=args.rep_ms))
    fn()  # warmup
    times = []
    for _ in range(args.cpu_iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device, args) -> float:
    """GB/s of a large device-to-device copy (read + write), the roofline for these ops."""
    n = (1 << 28) if device.type == "cuda" else (1 << 24)  # 1 GiB / 64 MiB of fp32
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, args)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def run_case(case: Case, provider: str, device, args, copy_gbs: float) -> dict:
    row = {"op": case.op, "shape": case.label, "provider": provider, "dtype": args.dtype}
    try:
        fn, extra = provider_fn(provider, case)
        leaves = [t for t in case.inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        leaves += extra
        fwd = lambda: fn(*case.inputs)
        out = fwd()  # compiles / autotunes outside the timed region
        grad = torch.randn_like(out)
        bwd = lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)
        bwd()
        row["fwd_ms"] = bench_ms(fwd, device, args)
        row["bwd_ms"] = bench_ms(bwd, device, args)
        row["peak_mb"] = peak_memory_mb(fwd, leaves, grad, device)
    except Unavailable as e:
        row["note"] = str(e)
        return row
    except Exception as e:  # keep benchmarking the rest; the table says what failed
        row["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        return row
    for phase, nbytes in (("fwd", case.bytes_fwd), ("bwd", case.bytes_bwd)):
        gbs = nbytes / (row[f"{phase}_ms"] * 1e-3) / 1e9
        row[f"{phase}_gbs"] = gbs
        row[f"{phase}_frac_copy"] = gbs / copy_gbs
    return row


def peak_memory_mb(fwd, leaves, grad, device) -> float | None:
    """Extra device memory at the peak of one forward + backward (inputs excluded)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(fwd(), leaves, grad)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# ---------------------------------------------------------------------------------- output
COLUMNS = [("op", 13), ("shape", 18), ("provider", 8), ("fwd_ms", 8), ("fwd_gbs", 8),
           ("fwd_frac_copy", 7), ("bwd_ms", 8), ("bwd_gbs", 8), ("bwd_frac_copy", 7),
           ("peak_mb", 9), ("note", 30)]  # fmt: skip


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.0f}"
    return str(value)


def print_header() -> None:
    names = {"fwd_frac_copy": "fwd/cp", "bwd_frac_copy": "bwd/cp", "fwd_gbs": "fwd GB/s",
             "bwd_gbs": "bwd GB/s"}  # fmt: skip
    print(" ".join(names.get(c, c).ljust(w) for c, w in COLUMNS))


def print_row(row: dict) -> None:
    print(" ".join(fmt(row.get(c)).ljust(w) for c, w in COLUMNS).rstrip(), flush=True)


def write_outputs(rows: list[dict], meta: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_kernels.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c, _ in COLUMNS] + ["dtype"])
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out_dir, "bench_kernels.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping bench_kernels.png (pip install matplotlib)")
        return
    plot(rows, meta, os.path.join(out_dir, "bench_kernels.png"), plt)


def plot(rows, meta, path, plt) -> None:
    """Bars of achieved / copy bandwidth per (op, shape), one bar per provider; fwd and bwd."""
    cases = list(dict.fromkeys((r["op"], r["shape"]) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.2 * len(cases)), 8), sharex=True)
    width = 0.8 / len(providers)
    for ax, phase in zip(axes, ("fwd", "bwd"), strict=True):
        for i, p in enumerate(providers):
            vals = [next((r.get(f"{phase}_frac_copy") or 0 for r in rows
                          if (r["op"], r["shape"], r["provider"]) == (*c, p)), 0)
                    for c in cases]  # fmt: skip
            ax.bar([k + i * width for k in range(len(cases))], vals, width, label=p)
        ax.axhline(0.85, color="gray", linestyle="--", linewidth=0.8)
        ax.set_ylabel(f"{phase}: achieved / copy bandwidth")
    axes[1].set_xticks([k + 0.4 - width / 2 for k in range(len(cases))])
    axes[1].set_xticklabels([f"{o}\n{s}" for o, s in cases], rotation=45, ha="right", fontsize=7)
    axes[0].legend(ncol=len(providers), fontsize=8)
    axes[0].set_title(f"{meta['device']} {meta['dtype']}, copy {meta['copy_gbs']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from {','.join(OPS)}")
    p.add_argument(
        "--providers",
        default=None,
        help=f"comma list from {','.join(PROVIDERS)} (default: all on a GPU, torch only on "
        "CPU; libraries that are not installed are reported and skipped)",
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        choices=list(DTYPES),
        help="input dtype on a GPU (CPU always uses fp32); default bf16",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one shape per op (hidden 4096, ffn 14336, vocab 128256)",
    )
    p.add_argument("--out-dir", default="runs/bench_kernels", help="where the CSV/JSON/PNG go")
    p.add_argument(
        "--rep-ms",
        type=int,
        default=100,
        help="GPU: milliseconds of timed repetitions per measurement (median)",
    )
    p.add_argument("--cpu-iters", type=int, default=3, help="CPU: timed runs (median)")
    args = p.parse_args(argv)
    for name, allowed in (("ops", OPS), ("providers", PROVIDERS)):
        value = getattr(args, name)
        bad = [v for v in (value.split(",") if value else []) if v not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; choose from {','.join(allowed)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        print(
            "No CUDA GPU found: timing the torch paths on CPU at reduced sizes (fp32). The "
            "Triton kernels need a GPU; tests/kernels checks them in the interpreter."
        )
        args.dtype = "fp32"
    providers = args.providers or ("triton,torch,compile,liger,te,apex" if gpu else "torch")
    dtype = DTYPES[args.dtype]
    copy_gbs = copy_bandwidth_gbs(device, args)
    name = torch.cuda.get_device_name() if gpu else platform.processor() or "cpu"
    print(f"device: {name}; copy bandwidth {copy_gbs:.1f} GB/s; dtype {args.dtype}")
    rows = []
    print_header()
    for op in args.ops.split(","):
        for tokens, width in shapes(op, gpu, args.quick):
            case = make_case(op, tokens, width, dtype, device)
            for provider in providers.split(","):
                rows.append(run_case(case, provider, device, args, copy_gbs))
                print_row(rows[-1])
            del case
            if gpu:
                torch.cuda.empty_cache()
    meta = {
        "device": name,
        "dtype": args.dtype,
        "copy_gbs": copy_gbs,
        "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
    }
    write_outputs(rows, meta, args.out_dir)
    print(f"wrote {args.out_dir}/bench_kernels.csv and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
