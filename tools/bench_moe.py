"""MoE layer benchmark: one MoE layer's forward+backward on CPU, 2 ranks (gloo, ep=2), fixed
tokens per rank and fixed active parameters (top-k · expert width constant), grouped-GEMM
experts against the per-expert loop at (E, top-k) = (8, 2), (64, 6), (256, 8).

    nice python tools/bench_moe.py [--tokens 1024] [--hidden 256] [--active-ffn 768] \
        [--dtype fp32|bf16] [--reps 3] [--configs 8:2,64:6,256:8] [--paths grouped,loop] \
        [--skew]

Each cell is the median over --reps timed steps (after one warm-up) of the slower rank's
forward+backward (router, dispatch all-to-alls, experts, combine, aux loss), each rank on one
thread; routing is the router's on random tokens (about balanced), or with --skew every token
has expert 0 among its top-k (E/k times the mean load). Prints the table (with rank 0's max/mean
tokens per expert), time(E=256)/time(E=8) per path (issue 21's target: ≤ 1.3 for
grouped) and the grouped speedup over the loop at E=64 (target: ≥ 3x).

Measured here (2 shared CPU cores, defaults, ms grouped / loop at E = 8, 64, 256; spread over
quiet runs): fp32 87-124 / 97-115, 128-199 / 289-300, 210-240 / 1788-1945, so
time(256)/time(8) = 1.7-2.8 for grouped and the E=64 speedup 1.5-2.3x (32 local experts per
rank keep the loop's per-expert cost small at h=256); --skew: 128-180 / 142-167, 160-205 /
307-320, 226-277 / 1746-2143. bf16 (CPU bf16 GEMMs are slow): 1419 / 1351, 1240 / 1278,
1283 / 2297. --hidden 1024 --active-ffn 3072: 827 / 927, 966 / 5086, 1583 / 54688 (E=64
speedup 5.3x: target met; time(256)/time(8) = 1.91); with --tokens 4096 too, grouped 3455,
4599, 5303 (1.53). The 1.3 target is out of reach on CPU: at 4096 tokens and h=1024 the GEMMs
alone (torch's CPU _grouped_mm runs one GEMM per expert, 128 rows each at E=256) take 2.73 s
at E=8 and 4.26 s at E=256 for the same FLOPs, already 1.34x the whole E=8 layer; top-8 also
moves 4x the token copies of top-2, and E=256 has 8x the expert parameters whose gradients
are written each step (docs/benchmarks.md, "Mixture of experts").

If tools/bench_moe_routing.py exists, its `balancing()` and `group_destinations()` run after
the table and what they return is printed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402  (no torch op runs in the parent before the ranks fork)
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


def _rank(rank: int, store: str, args, cells: list, queue) -> None:
    """One rank: for each (E, k, path) cell, the per-step times of one MoE layer."""
    import torch.distributed as dist

    from megatron_lite.moe import MoELayer

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    h, b = args.hidden, 4
    results = []
    for E, k, path in cells:
        torch.manual_seed(0)
        layer = MoELayer(
            h,
            args.active_ffn // k,
            E,
            k,
            ep_group=dist.group.WORLD,
            aux_loss_coeff=0.01,
            grouped_gemm=path == "grouped",
        )
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(args.tokens // b, b, h, generator=gen)
        if args.skew:  # a direction every token shares, which expert 0's router row follows
            v = torch.randn(h, generator=torch.Generator().manual_seed(1))
            x += 2 * v / v.norm()
            with torch.no_grad():
                layer.router.weight[0] = 10 * v / v.norm()
        layer.to(dtype)
        x = x.to(dtype).requires_grad_(True)
        dy = torch.randn(x.shape, generator=gen).to(dtype)
        times = []
        for step in range(args.reps + 1):
            for p in layer.parameters():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            layer(x).backward(dy)
            dist.barrier()  # the slower rank's time
            if step:  # the first is a warm-up
                times.append(time.perf_counter() - start)
        stats = layer.pop_stats()[0][0]  # this rank's tokens per expert: the hot one's share
        results.append((statistics.median(times), float(stats[:E].max() / stats[:E].mean())))
    dist.destroy_process_group()
    queue.put((rank, results))


def run(args) -> dict[tuple[int, int, str], float]:
    """Seconds per forward+backward of each (E, k, path) cell, the slower rank's."""
    cells = [(E, k, path) for E, k in args.configs for path in args.paths]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, store, args, cells, queue)) for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=args.timeout) for _ in procs)
        for p in procs:
            p.join()
    times = {cell: max(got[r][i][0] for r in got) for i, cell in enumerate(cells)}
    loads = {cell: got[0][i][1] for i, cell in enumerate(cells)}
    return times, loads


def report(args, times: dict, loads: dict) -> list[str]:
    routing = "skewed (every token picks expert 0)" if args.skew else "the router's (random)"
    lines = [
        f"MoE layer fwd+bwd, {WORLD} ranks ep={WORLD}, {args.tokens} tokens/rank, "
        f"h={args.hidden}, top-k·ffn={args.active_ffn}, {args.dtype}, {args.threads} thread/rank, "
        f"routing {routing}",
        f"{'E':>5} {'top-k':>5} {'ffn':>5} {'max/mean load':>13} "
        + " ".join(f"{p + ' ms':>11}" for p in args.paths),
    ]
    for E, k in args.configs:
        row = " ".join(f"{times[E, k, p] * 1e3:11.1f}" for p in args.paths)
        load = loads[E, k, args.paths[0]]
        lines.append(f"{E:5d} {k:5d} {args.active_ffn // k:5d} {load:13.1f} {row}")
    (e0, k0), (e1, k1) = args.configs[0], args.configs[-1]
    for p in args.paths:
        ratio = times[e1, k1, p] / times[e0, k0, p]
        lines.append(f"{p}: time(E={e1}) / time(E={e0}) = {ratio:.2f}")
    if {"grouped", "loop"} <= set(args.paths):
        for E, k in args.configs:
            speedup = times[E, k, "loop"] / times[E, k, "grouped"]
            lines.append(f"E={E}: grouped {speedup:.1f}x faster than the loop")
    return lines


def routing_hook() -> list[str]:
    """What tools/bench_moe_routing.py's balancing() and group_destinations() return, if that
    file exists."""
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(here, "bench_moe_routing.py")):
        return ["(tools/bench_moe_routing.py not present: routing benchmarks skipped)"]
    if here not in sys.path:  # a plain import: its ranks pickle its functions by module name
        sys.path.insert(0, here)
    module = importlib.import_module("bench_moe_routing")
    return [f"{name}(): {getattr(module, name)()}" for name in ("balancing", "group_destinations")]


def _configs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in pair.split(":")) for pair in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--active-ffn", type=int, default=768, help="top-k · expert width")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per cell (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--configs", type=_configs, default=_configs("8:2,64:6,256:8"), help="E:k,...")
    ap.add_argument("--paths", default="grouped,loop", help="grouped and/or loop")
    ap.add_argument("--skew", action="store_true", help="every token routes to expert 0")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for all cells")
    args = ap.parse_args(argv)
    args.paths = args.paths.split(",")
    for E, k in args.configs:
        if E % WORLD or args.active_ffn % k:
            ap.error(f"--configs {E}:{k}: E must divide by {WORLD}, --active-ffn by k")
    lines = report(args, *run(args))
    print("\n".join(lines + routing_hook()))


if __name__ == "__main__":
    main()
