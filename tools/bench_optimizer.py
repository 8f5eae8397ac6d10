"""train.optimizer=muon against AdamW: the optimizer step's time on this CPU, and how evenly
ZeRO-1 spreads Muon's Newton–Schulz work over the data-parallel ranks of the shipped configs.

    python tools/bench_optimizer.py                      # widths 256, 512, 1024; every config
    python tools/bench_optimizer.py --widths 512 --configs configs/llama3_8b.yaml --dp 8
    python tools/bench_optimizer.py --quick              # a few seconds (the unit test's)

Step time: one transformer layer's parameters at hidden size h (Llama's: fused q/k/v [3h, h],
output [h, h], fused gate/up [2f, h], down [h, f] with f = 8h/3 rounded up to 64, two norms
[h]), fp32 with gradients, stepped by the registered specs through `make_optimizer` as the
trainer builds them on one rank: "adamw" (every parameter) and "muon" (Muon on the four
matrices, each fused part orthogonalized alone; AdamW on the norms). The Newton–Schulz share
is the time of `muon.newton_schulz` alone on the same matrices (muon.matrix_shapes) over
Muon's step. Medians of --repeats steps after one warm-up, in process CPU time (other
processes on the machine do not count) on --threads torch threads (1 by default, so CPU time
is time); Newton–Schulz in --ns-dtype (fp32 by default here: training's bf16 runs on a GPU's
tensor cores, and a CPU without bf16 GEMM units runs it several times slower than fp32).

Load balance: ZeRO-1 owns each Muon parameter whole on one rank of its reduction group
(parallel/data_parallel/whole_matrix.owner_table: largest Newton–Schulz cost first, each to
the least-loaded rank). Per config (its own tp, pp, cp and ep; parallel.dp and zero_stage=1
set here), per pipeline rank and reduction group (dense over dp·cp, experts over dp·cp/ep), the
cost of each owner rank (muon.param_ns_flops of the parameters the planner measures on the meta
device, plan/params.optimizer_rows) and max/mean over the ranks; the table gives the worst
pipeline rank's. LPT over whole parameters cannot beat the largest parameter's cost: the
table gives that bound (largest / mean) beside it. A layout the config validation refuses is
listed with its reason.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_lite.parallel.data_parallel import muon  # noqa: E402
from megatron_lite.parallel.data_parallel.optimizer_spec import (  # noqa: E402
    get_optimizer,
    hyperparameters,
    make_optimizer,
)
from megatron_lite.parallel.params import set_meta  # noqa: E402

TARGET = 1.1  # issue #40: ZeRO-1 dp8 on Llama-3 8B, max/mean NS FLOPs per rank


# ---------------------------------------------------------------- step time
def layer_tensors(h: int) -> list[tuple[torch.nn.Parameter, str]]:
    """One Llama-shaped layer's parameters at hidden size h (module docstring), named as a
    model chunk names them, with gradients (seeded)."""
    f = -(-8 * h // 3 // 64) * 64
    shapes = {
        "layers.0.input_layernorm.weight": ((h,), None),
        "layers.0.self_attention.linear_qkv.weight": ((3 * h, h), (h, h, h)),
        "layers.0.self_attention.linear_proj.weight": ((h, h), None),
        "layers.0.pre_mlp_layernorm.weight": ((h,), None),
        "layers.0.mlp.linear_fc1.weight": ((2 * f, h), (f, f)),
        "layers.0.mlp.linear_fc2.weight": ((h, f), None),
    }
    g = torch.Generator().manual_seed(0)
    out = []
    for name, (shape, segments) in shapes.items():
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        set_meta(p, full_shape=shape, segments=segments)
        p.grad = torch.randn(shape, generator=g) * 1e-3
        out.append((p, name))
    return out


def _median_step(opt, repeats: int) -> float:
    opt.step()  # warm-up: the states are made here
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        opt.step()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def step_times(h: int, repeats: int, ns_dtype: str) -> dict:
    """{adamw_ms, muon_ms, ns_ms, ns_share} of one layer at hidden size h."""
    out = {"hidden": h}
    for name in ("adamw", "muon"):
        spec = get_optimizer(name)
        given = {"lr": 1e-3}
        if name == "muon":
            given["ns_dtype"] = ns_dtype
        hyper = hyperparameters(spec, given)
        tensors = layer_tensors(h)
        opt = make_optimizer(spec, [(p, p, n) for p, n in tensors], hyper, fused=False)
        out[f"{name}_ms"] = 1e3 * _median_step(opt, repeats)
    hyper = hyperparameters(get_optimizer("muon"), {"ns_dtype": ns_dtype})
    dtype = muon.NS_DTYPES[ns_dtype]
    shapes = [s for p, n in layer_tensors(h) if p.dim() == 2 for s in muon.matrix_shapes(p, True)]
    us = [torch.randn(s) for s in shapes]
    times = []
    for _ in range(repeats + 1):
        t0 = time.process_time()
        for u in us:
            muon.newton_schulz(u, hyper["ns_steps"], dtype)
        times.append(time.process_time() - t0)
    out["ns_ms"] = 1e3 * statistics.median(times[1:])
    out["ns_share"] = out["ns_ms"] / out["muon_ms"]
    steps = hyper["ns_steps"]
    out["ns_gflop"] = sum(muon.ns_flops(r, c, steps) for r, c in shapes) / 1e9
    return out


# ---------------------------------------------------------------- load balance
def layout_config(path: str, dp: int):
    """The config at `path` with parallel.dp=dp, zero_stage=1 and train.optimizer=muon,
    validated for its world (tp·pp·cp·dp); (config, None) or (None, the refusal)."""
    from megatron_lite.config import load_config
    from megatron_lite.plan.__main__ import with_vocab
    from megatron_lite.validation import validate

    overrides = [f"parallel.dp={dp}", "parallel.zero_stage=1", "train.optimizer=muon"]
    try:
        cfg = load_config(path, overrides)
        p = cfg.parallel
        world = p.tp * p.pp * p.cp * dp
        t = cfg.train  # a batch the new dp divides
        t.global_batch_size = math.lcm(t.global_batch_size, dp * t.micro_batch_size)
        return validate(with_vocab(cfg), world), None
    except Exception as e:  # noqa: BLE001 (the refusal is the figure)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def rank_costs(cfg, pp_rank: int) -> dict[str, list[float]]:
    """{"dense" / "experts": the NS FLOPs each owner rank of that reduction group steps} on
    pipeline rank `pp_rank` (whole_matrix.owner_table by the spec's cost, muon.param_ns_flops,
    the trainer's rule, over the parameters in the gradient buffers' order: the planner's
    plan/params.optimizer_rows), and each group's largest parameter's cost
    ("dense_largest", "experts_largest")."""
    from megatron_lite.parallel.data_parallel.whole_matrix import owner_table
    from megatron_lite.plan.params import optimizer_rows

    p = cfg.parallel
    rows = [r for c in range(p.vpp) for r in reversed(optimizer_rows(cfg, pp_rank, c))]
    out = {}
    for key, expert, n in (("dense", False, p.dp * p.cp), ("experts", True, p.dp * p.cp // p.ep)):
        whole = [r for r in rows if r.whole and r.is_expert == expert]
        n = max(n, 1)
        loads = [0.0] * n
        for r, k in zip(whole, owner_table(whole, n, lambda r: r.cost), strict=True):
            loads[k] += r.cost
        out[key], out[f"{key}_largest"] = loads, max((r.cost for r in whole), default=0.0)
    return out


def balance(path: str, dp: int) -> dict:
    """The worst pipeline rank's max/mean NS FLOPs per owner rank of `path` at dp (module
    docstring), per reduction group, with the largest parameter's bound."""
    cfg, refused = layout_config(path, dp)
    row = {"config": os.path.basename(path), "dp": dp}
    if cfg is None:
        return {**row, "note": refused}
    p = cfg.parallel
    row.update(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, note="")
    for key in ("dense", "experts"):
        worst = (0.0, 0.0, 0.0)  # (max/mean, largest/mean, max TFLOP)
        for rank in range(p.pp):
            c = rank_costs(cfg, rank)
            loads, largest = c[key], c[f"{key}_largest"]
            mean = sum(loads) / len(loads)
            if mean:
                worst = max(worst, (max(loads) / mean, largest / mean, max(loads) / 1e12))
        row[f"{key}_max_mean"], row[f"{key}_bound"], row[f"{key}_max_tflop"] = worst
    return row


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="256,512,1024", help="hidden sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (medians)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--ns-dtype", default="fp32", choices=sorted(muon.NS_DTYPES),
                        help="Newton–Schulz dtype (training's default bf16 is slow on a CPU "
                        "without bf16 GEMMs)")  # fmt: skip
    parser.add_argument("--configs", default="configs/*.yaml", help="glob or comma-separated")
    parser.add_argument("--dp", default="2,4,8", help="data-parallel degrees, comma-separated")
    parser.add_argument("--quick", action="store_true",
                        help="widths 64,128, 2 repeats, Llama-3 8B at dp 8 only")  # fmt: skip
    a = parser.parse_args(argv)
    if a.quick:
        a.widths, a.repeats, a.configs, a.dp = "64,128", 2, "configs/llama3_8b.yaml", "8"
    torch.set_num_threads(a.threads)
    print(f"optimizer step, one Llama-shaped layer, fp32, {a.threads} thread(s), NS in "
          f"{a.ns_dtype} (medians of {a.repeats})")  # fmt: skip
    print(f"{'hidden':>7} {'adamw ms':>9} {'muon ms':>9} {'muon/adamw':>10} {'NS ms':>8} "
          f"{'NS share':>8} {'NS GFLOP':>9}")  # fmt: skip
    for h in (int(w) for w in a.widths.split(",")):
        r = step_times(h, a.repeats, a.ns_dtype)
        print(f"{h:>7} {r['adamw_ms']:>9.2f} {r['muon_ms']:>9.2f} "
              f"{r['muon_ms'] / r['adamw_ms']:>10.1f} {r['ns_ms']:>8.2f} "
              f"{r['ns_share']:>8.0%} {r['ns_gflop']:>9.3f}")  # fmt: skip
    paths = sorted(
        q for pat in a.configs.split(",") for q in (glob.glob(pat) if "*" in pat else [pat])
    )
    print("\nZeRO-1 Muon load balance: max/mean NS FLOPs per owner rank (worst pp rank); "
          "bound = largest parameter / mean")  # fmt: skip
    print(f"{'config':<24} {'dp':>3} {'layout':<18} {'dense':>6} {'bound':>6} {'experts':>8} "
          f"{'bound':>6}  note")  # fmt: skip
    for path in paths:
        for dp in (int(d) for d in a.dp.split(",")):
            r = balance(path, dp)
            if r["note"]:
                print(f"{r['config']:<24} {dp:>3} {'-':<18} {'':>6} {'':>6} {'':>8} {'':>6}  "
                      f"{r['note']}")  # fmt: skip
                continue
            layout = f"tp{r['tp']} pp{r['pp']} cp{r['cp']} ep{r['ep']}"
            keys = ("dense_max_mean", "dense_bound", "experts_max_mean", "experts_bound")
            cells = [f"{r[k]:.3f}" if r[k] else "-" for k in keys]
            print(f"{r['config']:<24} {dp:>3} {layout:<18} {cells[0]:>6} {cells[1]:>6} "
                  f"{cells[2]:>8} {cells[3]:>6}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
