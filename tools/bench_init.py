"""Initialization cost per rank: time and peak host memory to draw one rank's shard of every
parameter of a ~110M-parameter Llama, at tp = 1, 2, 4, 8 (each in a fresh process).

    python tools/bench_init.py [--tp 1,2,4,8] [--layers 12] [--hidden 768]

Shard-local initialization (parallel/params.py `init_shard`) draws only the generator blocks a
shard touches, so time and memory should fall like 1/tp (the target: tp=8 at most 1/5 of tp=1);
`--full` times drawing every full tensor and slicing it, the cost before.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

# Run from a checkout without installing: make the repository root importable (here and in the
# child processes, which run this file).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def metas(tp: int, layers: int, hidden: int, ffn: int, vocab: int):
    from megatron_lite.parallel.params import ParamMeta

    kw = dict(tp_rank=0, tp_size=tp)
    padded = -(-vocab // (128 * tp)) * 128 * tp
    out = {"embedding.weight": ParamMeta((vocab, hidden), tp_dim=0, padded=padded, **kw)}
    for i in range(layers):
        p = f"layers.{i}."
        out[p + "input_norm.weight"] = ParamMeta((hidden,), init="ones")
        out[p + "qkv.weight"] = ParamMeta(
            (3 * hidden, hidden), tp_dim=0, segments=(hidden,) * 3, **kw
        )
        out[p + "proj.weight"] = ParamMeta((hidden, hidden), tp_dim=1, **kw)
        out[p + "pre_mlp_norm.weight"] = ParamMeta((hidden,), init="ones")
        out[p + "fc1.weight"] = ParamMeta((2 * ffn, hidden), tp_dim=0, segments=(ffn, ffn), **kw)
        out[p + "fc2.weight"] = ParamMeta((hidden, ffn), tp_dim=1, **kw)
    return out


def measure(tp: int, layers: int, hidden: int, full: bool) -> dict:
    """Run in a fresh process: draw rank 0's shards, keep them, report time and peak RSS."""
    import torch

    from megatron_lite.parallel.params import full_tensor, init_shard, shard

    torch.set_num_threads(1)
    params = metas(tp, layers, hidden, ffn=4 * hidden * 2 // 3 // 64 * 64, vocab=32000)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    kept = []
    for name, meta in params.items():
        kept.append(shard(full_tensor(meta, name, 0), meta) if full else init_shard(meta, name, 0))
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB
    total = sum(m.full_shape[0] * (m.full_shape[1] if len(m.full_shape) > 1 else 1)
                for m in params.values())  # fmt: skip
    return {"tp": tp, "params": total, "shard": sum(t.numel() for t in kept), "init_s": dt,
            "peak_mib": peak / 1024}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--full", action="store_true", help="draw full tensors, then slice")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.layers, args.hidden, args.full)))
        return
    rows = []
    for tp in (int(x) for x in args.tp.split(",")):
        cmd = [sys.executable, __file__, "--child", str(tp), "--layers", str(args.layers),
               "--hidden", str(args.hidden)] + (["--full"] if args.full else [])  # fmt: skip
        rows.append(
            json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        )
    first = rows[0]
    kind = "full tensors, then sliced" if args.full else "shard-local (init_shard)"
    print(f"init of rank 0's shards, {first['params'] / 1e6:.0f}M parameters, {kind}")
    print(f"{'tp':>3} {'shard M':>8} {'init s':>8} {'peak MiB':>9} {'time/tp1':>9} {'mem/tp1':>8}")
    for r in rows:
        time_ratio, mem_ratio = r["init_s"] / first["init_s"], r["peak_mib"] / first["peak_mib"]
        print(
            f"{r['tp']:>3} {r['shard'] / 1e6:>8.1f} {r['init_s']:>8.2f} {r['peak_mib']:>9.0f} "
            f"{time_ratio:>9.2f} {mem_ratio:>8.2f}"
        )


if __name__ == "__main__":
    main()
