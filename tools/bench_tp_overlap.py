"""Tensor-parallel communication that the backward exposes, with and without overlap (tp2 + SP,
two CPU gloo ranks, one torch thread each).

    python tools/bench_tp_overlap.py [--hidden 1024 --ffn 2048 --seq 2048 --layers 2 --iters 15]

The model is a stack of sequence-parallel MLP blocks (ColumnParallelLinear -> GELU ->
RowParallelLinear, weights with fp32 `main_grad` as under the gradient buffers). Every
iteration times one backward per mode (the slower rank's time), the modes interleaved so that
load from other processes hits them alike, and the time spent inside the backward's
collectives (blocking calls and waits: `blocked`; `in column`: the column-parallel layers'
launches and waits, the part the overlap can hide):

  off   overlap_tp_comm=False: each backward collective is waited for as soon as it starts,
        so backward = compute + blocked, and all of `blocked` is exposed
  on    overlap_tp_comm=True: the input re-gather runs under the dgrad GEMM, the input-gradient
        reduce-scatter under the wgrad GEMM

compute = backward(off) - blocked(off); exposed(on) = backward(on) - compute, which also counts
any slowdown of the GEMMs by the communication threads they share the cores with. The
row-parallel layer's all-gather of its output gradient precedes its GEMMs and stays exposed in
both modes. (Skipping the collectives instead leaves uninitialized buffers whose values slow
the GEMMs down, so this floor is not used.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("off", "on")


def _instrument(mappings):
    """Patch the collectives' runner and waits to add the time spent in them to `blocking`
    (blocking calls: the row-parallel layer's) or `async` (launches and waits: the column's)."""
    state = {"blocking": 0.0, "async": 0.0}
    run, wait = mappings._run, mappings.AsyncWork.wait

    def timed_run(kind, op, payload, group, fn):
        t = time.perf_counter()
        out = run(kind, op, payload, group, fn)
        state["async" if out is not None else "blocking"] += time.perf_counter() - t
        return out

    def timed_wait(self):
        t = time.perf_counter()
        wait(self)
        state["async"] += time.perf_counter() - t

    mappings._run, mappings.AsyncWork.wait = timed_run, timed_wait
    return state


def _rank(rank: int, store: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    from megatron_lite.parallel import mappings
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear

    g = dist.group.WORLD
    torch.manual_seed(0)
    blocks = []
    for _ in range(args.layers):
        col = ColumnParallelLinear(args.hidden, args.ffn, g, sequence_parallel=True)
        row = RowParallelLinear(args.ffn, args.hidden, g, sequence_parallel=True)
        blocks += [col, torch.nn.GELU(), row]
    model = torch.nn.Sequential(*blocks)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
        if p.dim() == 2:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    cols = [m for m in model if isinstance(m, ColumnParallelLinear)]
    state = _instrument(mappings)
    shape = (args.seq // 2, args.batch, args.hidden)  # [s/tp, b, h]
    x = torch.randn(shape, requires_grad=True)
    gout = torch.randn(shape)
    times = {m: [] for m in MODES}
    for it in range(args.warmup + args.iters):
        for mode in MODES if it % 2 else MODES[::-1]:  # alternate which mode goes first
            for c in cols:
                c.overlap_tp_comm = mode != "off"
            y = model(x)
            dist.barrier()
            state["blocking"] = state["async"] = 0.0
            t = time.perf_counter()
            y.backward(gout)
            elapsed = time.perf_counter() - t
            blocked = state["blocking"] + state["async"]
            t = torch.tensor([elapsed, blocked, state["async"]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank's
            if it >= args.warmup:
                times[mode].append(t.tolist())
            x.grad = None
            for p in model.parameters():
                p.grad = None
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"{tmp}/store"  # the FileStore removes it when done
        procs = [ctx.Process(target=_rank, args=(r, store, args, results)) for r in range(2)]
        for p in procs:
            p.start()
        times = results.get()
        for p in procs:
            p.join()
    med = {m: [statistics.median(v[i] for v in times[m]) * 1e3 for i in range(3)] for m in MODES}
    compute = med["off"][0] - med["off"][1]
    print(
        f"tp2+SP on CPU gloo: hidden {args.hidden}, ffn {args.ffn}, seq {args.seq}, "
        f"batch {args.batch}, {args.layers} MLP blocks, fp32; median of {args.iters} backwards"
    )
    head = ("mode", "backward ms", "blocked ms", "in column ms", "exposed ms")
    print(f"{head[0]:<6}" + "".join(f"{h:>14}" for h in head[1:]))
    for m in MODES:
        bwd, blocked, column = med[m]
        print(f"{m:<6}" + "".join(f"{v:>14.1f}" for v in (bwd, blocked, column, bwd - compute)))
    off, on = med["off"][0] - compute, med["on"][0] - compute
    print(f"compute (backward - blocked, overlap off): {compute:.1f} ms")
    print(f"exposed TP comm reduced by {100 * (1 - on / off):.0f}% (backward - compute)")
    print(f"time blocked in collectives reduced by {100 * (1 - med['on'][1] / med['off'][1]):.0f}%")


if __name__ == "__main__":
    main()
