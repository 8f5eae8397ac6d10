"""Context-parallel benchmark: load balance of ring attention, and activation memory per rank
against cp for every parallel.cp_comm_type, measured on CPU gloo ranks.

    python tools/bench_context_parallel.py                 # all three parts, ~17 min on 2 cores
    python tools/bench_context_parallel.py --part balance  # ring attention alone
    python tools/bench_context_parallel.py --part memory   # training runs, cp 1..8 per type
    python tools/bench_context_parallel.py --part long     # 16K tokens: cp 1 against cp 8

`balance`: one causal ring-attention layer (forward + backward) over --seq tokens on --cp
ranks, with the balanced split (chunks j and 2·cp−1−j) and the naive contiguous one; each
rank times its own block computation in CPU time (the waits for its peers and for a core
excluded: on a 2-core machine the 8 ranks take turns), and the table gives
the slowest rank against the mean.

`memory`: a tiny Llama trained for 2 steps at --seq tokens with cp = 1, 2, 4, 8 for each type
(a2a, p2p, a2a+p2p with cp_a2a_size 2); the activation bytes per rank are the run's measured
`mem/activations` (MemoryTracker: the step's peak, max over ranks), shown against 1/cp of the
cp = 1 run and of the type's cp = 2 run.

`long`: the same model at --long-seq tokens (16K) on one rank and with cp = 8 (p2p and
a2a+p2p): the one rank's activations exceed --budget-mib, the cp = 8 ranks' fit.

Figures go to <out-dir>/results.json and a printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------ process harness
def _rank_main(rank, world, store, fn, args, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException as e:  # the parent prints it and stops
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args, timeout: float = 900):
    """fn(rank, world, *args) on `world` gloo ranks; rank 0's return value (gathered by fn)."""
    import multiprocessing as mp
    import queue as queue_module

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, store, fn, args, queue), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    status, out = queue.get(timeout=1.0)
                except queue_module.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError("a rank failed; see its error above") from None
                    continue
                if status == "error":
                    raise RuntimeError(out)
                return out
            raise TimeoutError(f"ranks did not finish within {timeout:.0f} s")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


# ------------------------------------------------------------------ part 1: balance
def _balance_rank(rank, world, seq, heads, head_dim, balanced, reps):
    import torch
    import torch.distributed as dist

    from megatron_lite.context import ring
    from megatron_lite.context.layout import positions, ring_ranges

    torch.manual_seed(0)
    torch.set_num_threads(1)
    all_ranges = ring_ranges(seq, world, balanced)
    s_r = len(positions(all_ranges[rank]))
    q, k, v = (torch.randn(s_r, 1, heads, head_dim, requires_grad=True) for _ in range(3))
    spent = [0.0]
    fwd, bwd = ring.block_forward, ring._block_backward

    def timed(f):
        def run(*a):
            t0 = time.thread_time()  # CPU time: ranks share cores, so wall time includes waiting
            out = f(*a)
            spent[0] += time.thread_time() - t0
            return out

        return run

    ring.block_forward, ring._block_backward = timed(fwd), timed(bwd)
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        spent[0] = 0.0
        out = ring.ring_attention(q, k, v, dist.group.WORLD, all_ranges)
        out.sum().backward()
        if i:
            times.append(spent[0])
    mine = torch.tensor([statistics.median(times)])
    every = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(every, mine)
    return [float(t) for t in every]


def balance(a) -> list[dict]:
    rows = []
    for balanced in (True, False):
        per_rank = spawn(a.cp, _balance_rank, a.seq, 8, 32, balanced, a.reps)
        mean = statistics.mean(per_rank)
        rows.append({
            "split": "balanced (chunks j, 2cp-1-j)" if balanced else "naive contiguous",
            "cp": a.cp, "seq": a.seq, "rank_s": per_rank,
            "max_over_mean": max(per_rank) / mean,
        })  # fmt: skip
    return rows


# ------------------------------------------------------------------ part 2: memory
def _train_rank(rank, world, overrides, out_dir):
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare([f"train.out_dir={out_dir}", *overrides], world_size=world)
    mesh = ParallelMesh(rank_layout(cfg.parallel, world))
    t0 = time.perf_counter()
    records = Trainer(cfg, mesh, dataset, vocab).train()
    wall = time.perf_counter() - t0
    if dist.get_rank() == 0:
        r = records[-1]
        return {"activations": r.get("mem/activations", 0), "loss": r["loss"], "wall_s": wall}
    return None


def model_overrides(seq: int) -> list[str]:
    return [
        "data.mock=true", "model.vocab_size=256", "model.make_vocab_size_divisible_by=8",
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8",
        "model.num_query_groups=8", "model.ffn_hidden_size=128", f"model.seq_length={seq}",
        "train.micro_batch_size=1", "train.global_batch_size=1", "train.steps=2",
        "log.progress=false", "train.warmup_steps=1",
    ]  # fmt: skip


CP_TYPES = {"a2a": ["parallel.cp_comm_type=a2a"], "p2p": ["parallel.cp_comm_type=p2p"],
            "a2a+p2p": ["parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"]}  # fmt: skip


def _train_all(seq: int, layouts: list[tuple[str, int]]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, cp in layouts:
            over = [*model_overrides(seq), f"parallel.cp={cp}", *CP_TYPES[kind]]
            got = spawn(cp, _train_rank, over, os.path.join(tmp, f"{kind}{cp}"))
            rows.append({"type": kind, "cp": cp, "seq": seq, **got})
    for r in rows:
        r["act_mib"] = r["activations"] / 2**20
    return rows


def memory(a) -> list[dict]:
    layouts = [("a2a", 1)] + [(k, cp) for k in CP_TYPES for cp in (2, 4, 8)
                              if not (k == "a2a+p2p" and cp < 4)]  # fmt: skip
    rows = _train_all(a.seq, layouts)
    one = rows[0]["activations"]
    first = {}
    for r in rows:
        r["x_cp_vs_cp1"] = r["activations"] * r["cp"] / one  # 1.00: exactly 1/cp of cp = 1
        base = first.setdefault(r["type"], r) if r["cp"] > 1 else r
        r["x_cp_vs_first"] = r["activations"] * r["cp"] / (base["activations"] * base["cp"])
    return rows


def long(a) -> list[dict]:
    rows = _train_all(a.long_seq, [("a2a", 1), ("p2p", 8), ("a2a+p2p", 8)])
    for r in rows:
        r["fits_budget"] = r["act_mib"] <= a.budget_mib
    return rows


# ------------------------------------------------------------------ command line
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("balance", "memory", "long", "all"), default="all")
    p.add_argument("--seq", type=int, default=4096, help="total tokens (balance, memory)")
    p.add_argument("--long-seq", type=int, default=16384, help="total tokens (long)")
    p.add_argument("--cp", type=int, default=8, help="ring ranks for the balance part")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (balance)")
    p.add_argument("--budget-mib", type=float, default=64.0,
                   help="activation memory budget per rank (MiB) for the long part")  # fmt: skip
    p.add_argument("--out-dir", default="runs/bench_context_parallel")
    a = p.parse_args(argv)
    results = {"cpus": os.cpu_count(), "budget_mib": a.budget_mib}
    if a.part in ("balance", "all"):
        results["balance"] = balance(a)
        print(f"ring attention, causal, {a.seq} tokens on {a.cp} ranks (block compute per rank)")
        for r in results["balance"]:
            times = " ".join(f"{t * 1e3:.0f}" for t in r["rank_s"])
            print(f"  {r['split']:<30} max/mean {r['max_over_mean']:.3f}   ms/rank: {times}")
    if a.part in ("memory", "all"):
        results["memory"] = memory(a)
        print(f"activations per rank, {a.seq} tokens (measured mem/activations: peak, max rank)")
        print(f"  {'type':<8} {'cp':>3} {'MiB':>8} {'x cp/cp1':>9} {'x cp/first':>11}")
        for r in results["memory"]:
            print(f"  {r['type']:<8} {r['cp']:>3} {r['act_mib']:>8.2f} {r['x_cp_vs_cp1']:>9.3f}"
                  f" {r['x_cp_vs_first']:>11.3f}")  # fmt: skip
    if a.part in ("long", "all"):
        results["long"] = long(a)
        print(f"{a.long_seq} tokens, activation budget {a.budget_mib:g} MiB per rank")
        for r in results["long"]:
            fits = "fits" if r["fits_budget"] else "over budget"
            print(f"  {r['type']:<8} cp {r['cp']}: {r['act_mib']:7.1f} MiB  {fits}  loss "
                  f"{r['loss']:.4f}, {r['wall_s']:.0f} s for 2 steps")  # fmt: skip
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
