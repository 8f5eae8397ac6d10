"""Pipeline schedules side by side: step time and per-rank idle time of each schedule on the
same model, layout and microbatches, measured on CPU gloo ranks.

    python tools/bench_pipeline.py                           # pp 2, 1f1b and zb-h1
    python tools/bench_pipeline.py --pp 4 --microbatches 8   # 4 ranks (oversubscribes 2 cores)

Each schedule trains the same Llama (mock data, --layers of --hidden, fp32) for --steps steps
with train.profile_pipeline=true; the last step's pipeline trace gives each rank's busy time
(forward + backward + weight passes) and idle time (p2p waits and gaps) and the measured bubble
(idle / busy), beside the simulator's prediction for that schedule with the trace's mean costs.
Step time is the mean of the steps after the first. Each schedule runs --repeats times, the
schedules taking turns, and the table gives the medians (one step's trace on a shared CPU is
noisy). Keep the ranks at or below the cores: a rank waiting for a core looks idle. PyTorch's
own schedules (torch.distributed.pipelining) on the same split are not run here yet.

Figures go to <out-dir>/results.json, results.csv and timeline.png (one row per rank and
schedule: forwards, backwards and weight passes).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEDULES = ("1f1b", "zb-h1")  # what the trainer runs with vpp = 1


def _train_rank(rank, world, overrides, out_dir):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # no rank waits for a core

    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare([f"train.out_dir={out_dir}", *overrides], world_size=world)
    records = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab).train()
    if dist.get_rank() != 0:
        return None
    return [{"loss": r["loss"], "step_time_s": r["step_time_s"]} for r in records]


def overrides(a: argparse.Namespace, schedule: str) -> list[str]:
    return [
        "data.mock=true", "model.arch=llama", "model.vocab_size=256",
        "model.make_vocab_size_divisible_by=8", f"model.num_layers={a.layers}",
        f"model.hidden_size={a.hidden}", f"model.ffn_hidden_size={4 * a.hidden}",
        "model.num_attention_heads=4", "model.num_query_groups=4",
        f"model.seq_length={a.seq}", "train.micro_batch_size=1",
        f"train.global_batch_size={a.microbatches}", f"train.steps={a.steps}",
        "train.warmup_steps=1", "train.profile_pipeline=true", "log.progress=false",
        "log.memory_steps=0", f"parallel.pp={a.pp}", f"parallel.pipeline_schedule={schedule}",
    ]  # fmt: skip


def measure(a: argparse.Namespace, schedule: str, repeat: int) -> dict:
    from megatron_lite.pipeline.trace import TRACE_FILE, summarize
    from tools.bench_context_parallel import spawn

    out_dir = os.path.join(a.out_dir, f"{schedule}_{repeat}")
    records = spawn(a.pp, _train_rank, overrides(a, schedule), out_dir)
    with open(os.path.join(out_dir, TRACE_FILE)) as f:
        trace = json.load(f)
    s = summarize(trace)
    later = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    spans = [
        (e["pid"], e["cat"], e["ts"] / 1e6, e["dur"] / 1e6)
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e["cat"] in ("forward", "backward", "weight")
    ]
    return {
        "schedule": schedule,
        "step_time_s": statistics.mean(later),
        "window_s": s["window_s"],
        "bubble": s["bubble"],
        "idle_s": {str(r): v["idle_s"] for r, v in s["ranks"].items()},
        "simulated_bubble": s["predicted"].get("measured_costs"),
        "costs_ms": s["predicted"].get("costs_ms"),
        "losses": [r["loss"] for r in records],
        "spans": spans,
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median bubble, with the medians of step time and bubble over the runs."""
    pick = sorted(runs, key=lambda r: r["bubble"])[len(runs) // 2]
    return {**pick, "step_time_s": statistics.median(r["step_time_s"] for r in runs),
            "bubbles": [r["bubble"] for r in runs]}  # fmt: skip


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"forward": "tab:blue", "backward": "tab:orange", "weight": "tab:green"}
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.2 + 0.5 * len(results[0]["idle_s"])
                                                       * len(results)), squeeze=False)  # fmt: skip
    for ax, res in zip(axes[:, 0], results, strict=True):
        for rank, kind, start, dur in res["spans"]:
            ax.barh(rank, dur * 1e3, left=start * 1e3, color=colors[kind], edgecolor="white")
        ax.set_title(f"{res['schedule']}: step window {res['window_s'] * 1e3:.0f} ms, "
                     f"bubble {res['bubble']:.3f}", fontsize=9)  # fmt: skip
        ax.set_ylabel("rank")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("ms (last step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["F", "B", "W"], loc="upper right", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", "-m", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8, help="model layers (over pp stages)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="runs per schedule (medians)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, of {', '.join(SCHEDULES)}")  # fmt: skip
    parser.add_argument("--out-dir", default="runs/bench_pipeline")
    a = parser.parse_args(argv)
    names = [s for s in a.schedules.split(",") if s]
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown or not names:
        print(f"error: --schedules {a.schedules!r}: use names of {', '.join(SCHEDULES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if a.layers % a.pp:
        print(f"error: --layers {a.layers} must be a multiple of --pp {a.pp}", file=sys.stderr)
        return 2
    os.makedirs(a.out_dir, exist_ok=True)
    runs = {s: [] for s in names}
    for repeat in range(a.repeats):
        for s in names:
            runs[s].append(measure(a, s, repeat))
    results = [median_run(runs[s]) for s in names]

    base = results[0]
    print(f"pp={a.pp}, m={a.microbatches}, {a.layers} layers of {a.hidden}, seq {a.seq}, "
          f"{a.steps} steps (trace: the last)")  # fmt: skip
    print(f"{'schedule':>9} {'step ms':>8} {'bubble':>7} {'x ' + base['schedule']:>9} "
          f"{'simulated':>9}  idle ms per rank")  # fmt: skip
    rows = []
    for r in results:
        ratio = r["bubble"] / base["bubble"] if base["bubble"] else float("nan")
        sim = r["simulated_bubble"]
        idle = " ".join(f"{v * 1e3:.0f}" for v in r["idle_s"].values())
        print(f"{r['schedule']:>9} {r['step_time_s'] * 1e3:>8.1f} {r['bubble']:>7.3f} "
              f"{ratio:>9.2f} {sim if sim is None else round(sim, 3)!s:>9}  {idle}")  # fmt: skip
        rows.append({"schedule": r["schedule"], "step_time_s": r["step_time_s"],
                     "bubble": r["bubble"], "bubble_vs_first": ratio,
                     "simulated_bubble": sim, "final_loss": r["losses"][-1],
                     **{f"idle_s_rank{k}": v for k, v in r["idle_s"].items()}})  # fmt: skip
    with open(os.path.join(a.out_dir, "results.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "spans"} for r in results], f, indent=1)
    with open(os.path.join(a.out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(results, os.path.join(a.out_dir, "timeline.png"))
    print(f"results in {a.out_dir}/results.json, results.csv, timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
