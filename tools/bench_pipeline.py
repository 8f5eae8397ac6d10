"""Pipeline schedules side by side: step time and per-rank idle time of each schedule on the
same model, split and microbatches, ours and PyTorch's (torch.distributed.pipelining), on CPU
gloo ranks.

    python tools/bench_pipeline.py                            # pp 2, every schedule
    python tools/bench_pipeline.py --schedules 1f1b,zb-h1     # some of them
    python tools/bench_pipeline.py --pp 4 --microbatches 8    # 4 ranks (oversubscribes 2 cores)

Every schedule runs the same model: this repository's Llama chunks (build_model: the same
layout-independent initialization, --layers of --hidden, untied embeddings, fp32) on the
placement the schedule needs (loop: rank r holds virtual stages r, r + pp, ...; V: r and
2·pp − 1 − r), the same token batches (seeded per step) and AdamW. Ours run through our
engine (pipeline/engine.py `forward_backward`, the zero-bubble ones splitting B and W through
the linear layers' deferred weight GEMMs); PyTorch's wrap each chunk in a `PipelineStage` and
run `ScheduleInterleaved1F1B`, `ScheduleZBVZeroBubble` or `ScheduleDualPipeV` (its B/W split:
autograd.grad on inputs, then on weights). The losses must agree (same model, same data).

Each schedule trains --steps steps; the first (warm-up: PyTorch's shape inference) is not
timed. The last step's forward, backward and weight passes of every rank (spans from a
barrier-aligned clock; for PyTorch's, the stage's forward_one_chunk / backward_one_chunk /
backward_weight_one_chunk) give each rank's busy and idle time and the bubble (idle / busy),
beside our simulator's prediction for our schedules with the measured mean costs. Each
schedule runs --repeats times, the schedules taking turns; the table gives the medians. Keep
the ranks at or below the cores: a rank waiting for a core looks idle.

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

# PyTorch's: name -> (class in torch.distributed.pipelining.schedules, ours of the same split)
TORCH = {
    "torch-interleaved-1f1b": ("ScheduleInterleaved1F1B", "interleaved"),
    "torch-zbv": ("ScheduleZBVZeroBubble", "zb-v"),
    "torch-dualpipev": ("ScheduleDualPipeV", "dualpipev"),
}


def our_chunks() -> dict[str, int]:
    """Our registered schedules (their records) -> the chunks a rank holds: the record's vpp,
    2 where it runs on any vpp >= 2."""
    from megatron_lite.pipeline.registry import named_schedule, schedule_names

    return {name: named_schedule(name).vpp or 2 for name in schedule_names()}


def schedules() -> tuple[str, ...]:
    """Every name --schedules takes: ours, then PyTorch's."""
    return (*our_chunks(), *TORCH)


def model_overrides(a: argparse.Namespace, schedule: str) -> list[str]:
    """The config of the benchmark's model on `schedule`'s split (our schedule name)."""
    return [
        "data.mock=true", "model.arch=llama", "model.vocab_size=256",
        "model.make_vocab_size_divisible_by=8", f"model.num_layers={a.layers}",
        f"model.hidden_size={a.hidden}", f"model.ffn_hidden_size={4 * a.hidden}",
        "model.num_attention_heads=4", "model.num_query_groups=4", "model.tie_embeddings=false",
        f"model.seq_length={a.seq}", "train.micro_batch_size=1",
        f"train.global_batch_size={a.microbatches}", "log.progress=false",
        f"parallel.pp={a.pp}", f"parallel.vpp={our_chunks()[schedule]}",
        f"parallel.pipeline_schedule={schedule}", f"train.out_dir={a.out_dir}",
    ]  # fmt: skip


class TorchChunk:
    """Builds the nn.Module a PipelineStage runs for one of our model chunks: token ids [b, s]
    -> hidden [s, b, h] on the first virtual stage, hidden -> hidden in between, hidden ->
    fp32 logits [s, b, V] on the last (PyTorch's loss_fn takes them)."""

    @staticmethod
    def wrap(chunk):
        import torch

        class _Stage(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.chunk = chunk

            def forward(self, x):
                c = self.chunk
                if c.pre_process:
                    x = c.embed(x)
                x = c.run_layers(x, c.token_context())
                if not c.post_process:
                    return x
                return c.output_layer(c.final_norm(x), c.output_weight()).float()

        return _Stage()


def _bench_rank(rank, world, args: dict, name: str):
    """One schedule on this rank for args["steps"] steps; rank 0 returns every rank's step
    times, the losses and the last step's spans."""
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # no rank waits for a core

    from megatron_lite.models import build_model
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.pipeline.schedules import schedule_placement, virtual_stage
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare

    a = argparse.Namespace(**args)
    ours = name in our_chunks()
    schedule = name if ours else TORCH[name][1]
    cfg, _, vocab = prepare(model_overrides(a, schedule), world_size=world)
    mesh = ParallelMesh(rank_layout(cfg.parallel, world))
    tracker = model_parallel_seed(cfg.train.seed, mesh.tp.rank, mesh.pp.rank)
    chunks = build_model(cfg, mesh, tracker, vocab)
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)
    m, s, h, vpp = a.microbatches, a.seq, a.hidden, our_chunks()[schedule]
    place = schedule_placement(schedule, vpp)
    stages_of = [virtual_stage(mesh.pp.rank, c, a.pp, place) for c in range(vpp)]
    holds_loss = any(c.post_process for c in chunks)
    spans: list[tuple] = []
    clock = [time.perf_counter()]

    def timed(kind: str, chunk: int, fn):
        def run(*fargs, **kw):
            start = time.perf_counter() - clock[0]
            out = fn(*fargs, **kw)
            mb = fargs[0] if fargs else kw.get("fwd_chunk_id", kw.get("bwd_chunk_id", -1))
            spans.append((kind, int(mb), chunk, start, time.perf_counter() - clock[0]))
            return out

        return run

    if ours:
        from megatron_lite.pipeline.engine import forward_backward
        from megatron_lite.pipeline.trace import SpanRecorder
        from megatron_lite.training.lm_step import lm_forward_step

        step_fn = lm_forward_step("fp32", torch.device("cpu"))
    else:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules

        stages = []
        for c, chunk in enumerate(chunks):
            stage = PipelineStage(TorchChunk.wrap(chunk), stages_of[c], a.pp * vpp,
                                  torch.device("cpu"), group=mesh.pp.group)  # fmt: skip
            stage.forward_one_chunk = timed("forward", c, stage.forward_one_chunk)
            stage.backward_one_chunk = timed("backward", c, stage.backward_one_chunk)
            stage.backward_weight_one_chunk = timed("weight", c, stage.backward_weight_one_chunk)
            stages.append(stage)

        def loss_fn(logits, target):  # [s, b, V], [b, s]: the microbatch's mean
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.t().flatten())

        sched = getattr(torch_schedules, TORCH[name][0])(stages, n_microbatches=m, loss_fn=loss_fn)

    times, losses = [], []
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, 256, (m, 1, s + 1), generator=g)  # m samples [b=1, s + 1]
        spans.clear()
        dist.barrier(group=mesh.pp.group)
        clock[0] = t0 = time.perf_counter()
        if ours:
            recorder = SpanRecorder()
            recorder.t0 = t0
            total = forward_backward(
                chunks, list(ids), step_fn, pp_group=mesh.pp.group, tensor_shape=(s, 1, h),
                loss_scale=1.0 / (m * s), recorder=recorder, schedule=schedule,
            )  # fmt: skip
            spans.extend(sp for sp in recorder.spans if sp[0] in ("forward", "backward", "weight"))
            loss = total.float() / (m * s)
        else:
            inputs, target = ids[:, 0, :-1], ids[:, 0, 1:]  # [m, s] each: one sample a row
            kw, mb_losses = {}, []
            if holds_loss:
                kw = {"target": target, "losses": mb_losses}
            first = 0 in stages_of
            sched.step(*((inputs,) if first else ()), **kw)
            loss = torch.stack(mb_losses).mean() if mb_losses else torch.zeros(())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier(group=mesh.pp.group)
        times.append(time.perf_counter() - t0)
        loss = loss.detach().double().reshape(1)
        dist.all_reduce(loss, group=mesh.pp.group)  # only the rank of the loss adds it
        losses.append(loss.item())
    order = [] if ours else [str(x) for x in sched.pipeline_order[mesh.pp.rank] if x is not None]
    mine = (mesh.pp.rank, times, list(spans), order)
    gathered = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    return {"losses": losses, "ranks": [g[:3] for g in gathered],
            "orders": [g[3] for g in gathered]}  # fmt: skip


def measure(a: argparse.Namespace, name: str) -> dict:
    from megatron_lite.pipeline.trace import chrome_events, summarize
    from tools.bench_context_parallel import spawn

    keys = ("pp", "microbatches", "layers", "hidden", "seq", "steps", "out_dir")
    args = {k: getattr(a, k) for k in keys}
    out = spawn(a.pp, _bench_rank, args, name)
    ours = name in our_chunks()
    schedule = name if ours else TORCH[name][1]
    events = [e for rank, _, spans in out["ranks"] for e in chrome_events(rank, rank, spans)]
    meta = {"pp": a.pp, "vpp": our_chunks()[schedule], "schedule": schedule}
    if ours:  # our simulator predicts our tables only
        meta["num_microbatches"] = a.microbatches
    s = summarize({"traceEvents": events, "otherData": meta})
    per_step = [max(ts) for ts in zip(*(times for _, times, _ in out["ranks"]), strict=True)]
    return {
        "schedule": name,
        "implementation": "ours" if ours else "pytorch",
        "step_time_s": statistics.mean(per_step[1:] or per_step),
        "window_s": s["window_s"],
        "bubble": s["bubble"],
        "idle_s": {str(r): v["idle_s"] for r, v in s["ranks"].items()},
        "simulated_bubble": s["predicted"].get("measured_costs"),
        "costs_ms": s["predicted"].get("costs_ms") or _costs_ms(events),
        "losses": out["losses"],
        "pipeline_order": out["orders"],  # PyTorch's actions per rank, as it prints them
        "spans": [
            (rank, kind, st, en - st)
            for rank, _, spans in out["ranks"]
            for kind, _, _, st, en in spans
        ],  # fmt: skip
    }


def _costs_ms(events: list[dict]) -> dict:
    """Mean forward, backward and weight pass of a trace, in ms (0 where none ran)."""
    out = {}
    for kind in ("forward", "backward", "weight"):
        durs = [e["dur"] / 1e3 for e in events if e.get("ph") == "X" and e["cat"] == kind]
        out[kind] = sum(durs) / len(durs) if durs else 0.0
    return out


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
    parser.add_argument("--layers", type=int, default=8,
                        help="model layers (a multiple of 2·pp: two chunks a rank)")  # fmt: skip
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="the first is not timed")
    parser.add_argument("--repeats", type=int, default=3, help="runs per schedule (medians)")
    names = schedules()
    parser.add_argument("--schedules", default=",".join(names),
                        help=f"comma-separated, of {', '.join(names)}")  # fmt: skip
    parser.add_argument("--out-dir", default="runs/bench_pipeline")
    a = parser.parse_args(argv)
    names = [s for s in a.schedules.split(",") if s]
    unknown = [s for s in names if s not in schedules()]
    if unknown or not names:
        print(f"error: --schedules {a.schedules!r}: use names of {', '.join(schedules())}",
              file=sys.stderr)  # fmt: skip
        return 2
    chunks_of = our_chunks()
    chunks = max(chunks_of[n if n in chunks_of else TORCH[n][1]] for n in names)
    if a.layers % (a.pp * chunks):
        print(f"error: --layers {a.layers} must be a multiple of {a.pp * chunks} "
              f"(--pp {a.pp} × {chunks} chunks a rank)", file=sys.stderr)  # fmt: skip
        return 2
    from megatron_lite.pipeline.registry import microbatches_problem

    for n in names:  # each schedule record's microbatch rules (PyTorch's: ours of its split)
        schedule = n if n in chunks_of else TORCH[n][1]
        problem = microbatches_problem(a.pp, a.microbatches, chunks_of[schedule], schedule)
        if problem:
            print(f"error: --microbatches {a.microbatches} ({n}): {problem}", file=sys.stderr)
            return 2
    os.makedirs(a.out_dir, exist_ok=True)
    runs = {s: [] for s in names}
    for _ in range(a.repeats):
        for s in names:
            runs[s].append(measure(a, s))
    results = [median_run(runs[s]) for s in names]

    base = results[0]
    print(f"pp={a.pp}, m={a.microbatches}, {a.layers} layers of {a.hidden}, seq {a.seq}, "
          f"{a.steps} steps (trace: the last), medians of {a.repeats}")  # fmt: skip
    print(f"{'schedule':>23} {'step ms':>8} {'bubble':>7} {'x ' + base['schedule']:>9} "
          f"{'simulated':>9} {'final loss':>10}  idle ms per rank")  # fmt: skip
    rows = []
    for r in results:
        ratio = r["bubble"] / base["bubble"] if base["bubble"] else float("nan")
        sim = r["simulated_bubble"]
        idle = " ".join(f"{v * 1e3:.0f}" for v in r["idle_s"].values())
        print(f"{r['schedule']:>23} {r['step_time_s'] * 1e3:>8.1f} {r['bubble']:>7.3f} "
              f"{ratio:>9.2f} {sim if sim is None else round(sim, 3)!s:>9} "
              f"{r['losses'][-1]:>10.5f}  {idle}")  # fmt: skip
        rows.append({"schedule": r["schedule"], "implementation": r["implementation"],
                     "step_time_s": r["step_time_s"], "bubble": r["bubble"],
                     "bubble_vs_first": ratio, "simulated_bubble": sim,
                     "final_loss": r["losses"][-1],
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
