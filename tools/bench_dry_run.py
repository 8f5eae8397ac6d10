"""Dry-run benchmark: the planner's memory terms against the real training step at full size
(plan --dry-run: fake process group, fake tensors) on a list of production layouts, with the
dry run's own cost (wall time, host memory).

    nice python tools/bench_dry_run.py [--only 8b-*,70b-config] [--kernels fused|torch] \
        [--microbatches steady] [--workers 1] [--out runs/bench_dry_run] [--list]

Each dry-run rank runs in a fresh spawned child (the fake process group is process-global
state, and the child's peak resident set size is then that rank's alone): by default one rank
per pipeline stage (`dry_run.default_ranks`), or the layout's chosen subset. Per layout and
rank the table gives, for every term of `dry_run.PLANNER_TERMS`, the dry run's bytes at the
step-2 peak, the planner's (`plan.memory.rank_memory`) and their ratio, then the peak's ratio,
the phase of the peak, the child's wall time and its peak RSS (getrusage of the child itself).
Writes table.txt, summary.md (one markdown row per layout: docs/benchmarks.md's table), results.csv
(one row per layout, rank and term) and results.json under --out.

The layouts are full size: Llama-3 8B on 8 GPUs, the shipped Llama-3 70B (and the planner
search's top three of it on 64 GPUs) and 405B configs, a Mixtral-8x7B-shaped MoE, a
fine-grained (DeepSeek-MoE-like) MoE and DeepSeek-V3 671B (MLA, MTP), covering ZeRO 0-3,
HSDP, recompute none/selective/full, interleaving, uneven stages, CP, EP, bf16 and fp32.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30
TOLERANCE = 0.03  # the planner's claim: every term and the peak within 3% of the dry run


@dataclass(frozen=True)
class Layout:
    """A config file, the world size and the overrides that make the layout; `ranks` None:
    one rank per pipeline stage."""

    name: str
    config: str
    world: int
    overrides: tuple[str, ...] = ()
    ranks: tuple[int, ...] | None = None


FULL = (
    "model.recompute_granularity=full",
    "model.recompute_method=uniform",
    "model.recompute_num_layers=1",
)
SELECTIVE = ("model.recompute_granularity=selective",)
NO_SP = ("parallel.sequence_parallel=false",)
B8, B70, B405 = "configs/llama3_8b.yaml", "configs/llama3_70b.yaml", "configs/llama3_405b.yaml"
MIXTRAL, FINE = "configs/mixtral_8x7b.yaml", "configs/moe_fine_grained.yaml"
DSV3 = "configs/deepseek_v3.yaml"


def _p(**kw) -> tuple[str, ...]:
    return tuple(f"parallel.{k}={v}" for k, v in kw.items())


# fmt: off
LAYOUTS = [
    # Llama-3 8B on one node of 8 GPUs
    Layout("8b-tp1-z1-full", B8, 8, _p(tp=1, dp=8, zero_stage=1) + NO_SP + FULL),
    Layout("8b-tp1-z2-sel", B8, 8, _p(tp=1, dp=8, zero_stage=2) + NO_SP + SELECTIVE
           + ("model.recompute_modules=[core_attn,mlp]",)),
    Layout("8b-tp1-z3-full", B8, 8, _p(tp=1, dp=8, zero_stage=3) + NO_SP + FULL),
    Layout("8b-tp1-z3-m1", B8, 8, _p(tp=1, dp=8, zero_stage=3) + NO_SP + FULL
           + ("train.global_batch_size=8",)),
    Layout("8b-tp1-hsdp4", B8, 8, _p(tp=1, dp=8, zero_stage=3, dp_shard=4) + NO_SP + FULL),
    Layout("8b-tp2-z1", B8, 8),  # the config as shipped
    Layout("8b-tp2-block", B8, 8, ("model.recompute_granularity=full",
           "model.recompute_method=block", "model.recompute_num_layers=16")),
    Layout("8b-tp2-cp2", B8, 8, _p(tp=2, cp=2, dp=2, zero_stage=1)),
    Layout("8b-tp2-pp2-vpp2", B8, 8, _p(tp=2, pp=2, vpp=2, dp=2, zero_stage=1)),
    Layout("8b-tp8-z0", B8, 8, _p(tp=8, dp=1, zero_stage=0)),
    Layout("8b-tp8-fp32-mbs2", B8, 8, _p(tp=8, dp=1, zero_stage=1)
           + ("train.precision=fp32", "train.micro_batch_size=2")),
    Layout("8b-tp4-pp2-fp32-sel", B8, 8, _p(tp=4, pp=2, dp=1, zero_stage=1) + SELECTIVE
           + ("train.precision=fp32",)),
    # GPT-3 6.7B's shape (Brown et al. 2020: LayerNorm, GeLU, biases, learned positions)
    Layout("gpt3-6.7b-tp2-z2", B8, 8, _p(tp=2, dp=4, zero_stage=2) + (
           "model.arch=gpt", "model.num_query_groups=32", "model.ffn_hidden_size=16384",
           "model.seq_length=2048", "model.vocab_size=50257")),
    # Llama-3 70B on 64 GPUs: the shipped config and the planner search's top three
    Layout("70b-config", B70, 64),
    Layout("70b-search1", B70, 64, _p(tp=8, pp=1, vpp=1, dp=8, zero_stage=2)),
    Layout("70b-search2", B70, 64, _p(tp=4, pp=4, vpp=3, cp=2, dp=2, zero_stage=1,
           decoder_first_pipeline_num_layers=5, decoder_last_pipeline_num_layers=5)),
    Layout("70b-search3", B70, 64, _p(tp=4, pp=4, vpp=3, cp=2, dp=2, zero_stage=2,
           decoder_first_pipeline_num_layers=5, decoder_last_pipeline_num_layers=5)),
    # Llama-3 405B on 1,024 GPUs, as shipped (tp8 pp4 vpp4 cp2, uneven first/last stages)
    Layout("405b-config", B405, 1024),
    # and the planner search's first pick on 1,024 GPUs (16 stage ranks)
    Layout("405b-search1", B405, 1024, _p(tp=8, pp=16, vpp=4, cp=2, dp=4, zero_stage=1,
           decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1)),
    # Mixtral-8x7B-shaped MoE, ep8
    Layout("mixtral-config", MIXTRAL, 64),  # tp1 pp4 ep8 dp16
    Layout("mixtral-tp2-sel", MIXTRAL, 64, _p(tp=2, pp=2, ep=8, dp=16, zero_stage=2,
           sequence_parallel="true") + SELECTIVE + ("model.recompute_modules=[moe]",)),
    # fine-grained MoE: 64 experts, top-6
    Layout("fine-config", FINE, 8),  # ep8 dp8
    Layout("fine-pp2-full", FINE, 16, _p(pp=2, ep=8, dp=8, zero_stage=2) + FULL),
    # DeepSeek-V3 671B (MLA, MTP 1, 256 experts) on 1,024 H100s, as shipped (tp2+SP pp16 ep32)
    Layout("dsv3-config", DSV3, 1024),
    # and the planner search's first pick (expert groups inside a node, Ulysses over 8): the
    # first two stages, a middle one and the last (MTP and loss)
    Layout("dsv3-search1", DSV3, 1024, _p(tp=1, pp=16, cp=8, ep=8, dp=8,
           sequence_parallel="false") + ("model.recompute_granularity=null",),
           ranks=(0, 64, 512, 960)),
]
# fmt: on


# ------------------------------------------------------------------ one dry-run rank (a child)
def resolved_config(layout: Layout):
    """The layout's config, validated for its world size (what plan --dry-run runs)."""
    from megatron_lite.config import load_config
    from megatron_lite.plan.__main__ import with_vocab
    from megatron_lite.validation import validate

    return validate(with_vocab(load_config(layout.config, list(layout.overrides))), layout.world)


def run_one(layout: Layout, rank: int, kernels: str, microbatches: str) -> dict:
    """Dry-run `rank` of `layout` here (a fresh child): its dry_run.to_json figures, plus
    wall_s and rss_bytes of this process."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_lite.plan.dry_run import dry_run, to_json

    t0 = time.perf_counter()
    cfg = resolved_config(layout)
    (res,) = dry_run(cfg, layout.world, [rank], microbatches, 1, kernels)
    (result,) = to_json([res])
    result["predicted_phase"] = res.predicted.phase if res.predicted else ""
    result["child_wall_s"] = time.perf_counter() - t0
    result["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB
    return result


def layout_ranks(layout: Layout) -> list[int]:
    from megatron_lite.plan.dry_run import default_ranks

    if layout.ranks is not None:
        return list(layout.ranks)
    return default_ranks(resolved_config(layout), layout.world)


# ------------------------------------------------------------------ the table
TERMS = (
    "weights",
    "grads",
    "master",
    "optimizer",
    "buffers",
    "activations",
    "gathered+temporaries",
)
SHORT = ("wts", "grads", "master", "optim", "buf", "act", "work")


def ratio(got: float, want: float) -> float | None:
    if want:
        return got / want
    return None if got else 1.0


def rows(layout: Layout, res: dict) -> list[dict]:
    """One CSV row per term and the peak."""
    out = []
    items = [(t, res["compared"][t], res["predicted"][t]) for t in TERMS]
    items.append(("peak", res["peak_bytes"], res["predicted_peak_bytes"]))
    for term, got, want in items:
        out.append({
            "layout": layout.name, "rank": res["rank"], "pp_rank": res["coords"]["pp"],
            "term": term, "dry_run_gib": got / GIB, "planner_gib": want / GIB,
            "ratio": ratio(got, want), "phase": res["peak_phase"],
            "planner_phase": res.get("predicted_phase", ""),
            "microbatches": res["microbatches"], "wall_s": res["child_wall_s"],
            "rss_gib": res["rss_bytes"] / GIB,
        })  # fmt: skip
    return out


def _cell(got: float, want: float) -> str:
    r = ratio(got, want)
    mark = "" if r is None or abs(r - 1) <= TOLERANCE else "!"
    text = "—" if r is None else f"{r:.3f}"
    return f"{got / GIB:6.2f}/{want / GIB:6.2f} {text:>5s}{mark:1s}"


def table(results: list[tuple[Layout, dict]]) -> str:
    """Per layout and rank: dry run / planner GiB and the ratio of each term, the peak's,
    the phase of the peak, wall time and RSS; ! marks a ratio off by more than TOLERANCE."""
    head = f"{'layout':20s} {'pp':>2s} " + " ".join(f"{s:>19s}" for s in (*SHORT, "peak"))
    head += f"  {'wall s':>6s} {'RSS GiB':>7s}  phase of the peak: dry run / planner"
    lines = ["dry run GiB / planner GiB, ratio (! off by more than 3%)", head]
    for layout, res in results:
        cells = [_cell(res["compared"][t], res["predicted"][t]) for t in TERMS]
        cells.append(_cell(res["peak_bytes"], res["predicted_peak_bytes"]))
        lines.append(
            f"{layout.name:20s} {res['coords']['pp']:2d} "
            + " ".join(cells)
            + f"  {res['child_wall_s']:6.1f} {res['rss_bytes'] / GIB:7.2f}  {res['peak_phase']}"
            + f" / {res.get('predicted_phase', '')}"
        )
    return "\n".join(lines)


SMALL = 0.05 * GIB  # terms under this are left out of the worst-term column


def _worst(res: dict) -> tuple[str, float]:
    """The term furthest from 1 among those of at least SMALL (dry run or planner)."""
    worst, far = ("", 1.0), -1.0
    for t in TERMS:
        got, want = res["compared"][t], res["predicted"][t]
        r = ratio(got, want)
        if max(got, want) >= SMALL and r is not None and abs(r - 1) > far:
            worst, far = (t, r), abs(r - 1)
    return worst


def summary(results: list[tuple[Layout, dict]]) -> str:
    """A markdown table, one row per layout (docs/benchmarks.md's): its largest dry-run peak and
    the planner's, the peak ratio furthest from 1 over its ranks and the worst term; then
    how many layouts have every term (of at least SMALL) and the peak within TOLERANCE."""
    by_layout: dict[str, list] = {}
    for lay, res in results:
        by_layout.setdefault(lay.name, [lay, []])[1].append(res)
    lines = [
        "| layout | overrides of the config | ranks | largest dry-run peak GiB (pp rank) "
        "| planner GiB | peak ratio | worst term (ratio) |",
        "|---|---|---|---|---|---|---|",
    ]
    good = 0
    for lay, ranks in by_layout.values():
        top = max(ranks, key=lambda r: r["peak_bytes"])
        peaks = [ratio(r["peak_bytes"], r["predicted_peak_bytes"]) for r in ranks]
        peak = max(peaks, key=lambda r: abs(r - 1))
        worsts = [_worst(r) for r in ranks]
        term, tr = max(worsts, key=lambda w: abs(w[1] - 1))
        good += abs(peak - 1) <= TOLERANCE and abs(tr - 1) <= TOLERANCE
        short = " ".join(o.split(".", 1)[-1] for o in lay.overrides) or "as shipped"
        config = os.path.basename(lay.config).removesuffix(".yaml")
        lines.append(
            f"| {lay.name} | {config}: {short} | {len(ranks)} | {top['peak_bytes'] / GIB:.2f} "
            f"({top['coords']['pp']}) | {top['predicted_peak_bytes'] / GIB:.2f} | {peak:.3f} "
            f"| {term or '—'} {tr:.3f} |"
        )
    lines.append("")
    lines.append(
        f"{good} of {len(by_layout)} layouts ({len(results)} ranks): every term of at least "
        f"{SMALL / GIB:.2f} GiB and the peak within {TOLERANCE:.0%} on every rank"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------ the command line
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma-separated layout names or globs")
    p.add_argument("--kernels", default="fused", choices=("fused", "torch"))
    p.add_argument("--microbatches", default="steady", help="steady, all or a count")
    p.add_argument("--workers", type=int, default=1, help="dry-run children at once")
    p.add_argument("--out", default="runs/bench_dry_run", help="folder for the outputs")
    p.add_argument("--list", action="store_true", help="print the layouts and exit")
    replan_help = (
        "score the dry runs of an earlier results.json against the current planner (no dry "
        "run: the measured figures do not depend on the planner)"
    )
    p.add_argument("--replan", default=None, metavar="RESULTS_JSON", help=replan_help)
    return p.parse_args(argv)


def replanned(entry: dict) -> dict:
    """An earlier results.json entry with the current planner's terms and phase."""
    from megatron_lite.plan.dry_run import PLANNER_TERMS
    from megatron_lite.plan.memory import rank_memory

    layout = next(lay for lay in LAYOUTS if lay.name == entry["layout"])
    pred = rank_memory(resolved_config(layout), layout.world, entry["coords"]["pp"],
                       entry["kernels"])  # fmt: skip
    out = dict(entry)
    out["predicted"] = {k: sum(pred.terms.get(t, 0.0) for t in v) for k, v in PLANNER_TERMS.items()}
    out["predicted_peak_bytes"] = pred.total
    out["predicted_phase"] = pred.phase
    return out


def chosen(only: str | None) -> list[Layout]:
    if not only:
        return list(LAYOUTS)
    pats = [s.strip() for s in only.split(",") if s.strip()]
    picked = [lay for lay in LAYOUTS if any(fnmatch.fnmatch(lay.name, p) for p in pats)]
    if not picked:
        raise SystemExit(f"--only={only!r} matches no layout; see --list")
    return picked


def dry_runs(layouts: list[Layout], a: argparse.Namespace) -> list[tuple[Layout, dict]]:
    """Every chosen rank of `layouts`, each in a fresh spawned child (its own fake process
    group, its own peak RSS), `a.workers` at a time; prints each row as it comes."""
    import multiprocessing as mp

    jobs = [(lay, r) for lay in layouts for r in layout_ranks(lay)]
    results = []
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(a.workers, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = [pool.submit(run_one, lay, r, a.kernels, a.microbatches) for lay, r in jobs]
        for (lay, _), fut in zip(jobs, futures, strict=True):
            res = fut.result()
            res["kernels"] = a.kernels
            results.append((lay, res))
            print(table([(lay, res)]).splitlines()[-1], flush=True)
    return results


def main(argv=None) -> int:
    a = parse_args(argv)
    layouts = chosen(a.only)
    if a.list:
        for lay in layouts:
            print(f"{lay.name:20s} {lay.config} world {lay.world} {' '.join(lay.overrides)}")
        return 0
    os.makedirs(a.out, exist_ok=True)
    results: list[tuple[Layout, dict]] = []
    if a.replan:
        with open(a.replan) as f:
            earlier = json.load(f)
        names = {lay.name for lay in layouts}
        by_name = {lay.name: lay for lay in LAYOUTS}
        results = [(by_name[e["layout"]], replanned(e)) for e in earlier if e["layout"] in names]
    else:
        results = dry_runs(layouts, a)
    text = table(results)
    print("\n" + text)
    with open(os.path.join(a.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    md = summary(results)
    print("\n" + md)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(md + "\n")
    all_rows = [row for lay, res in results for row in rows(lay, res)]
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(all_rows[0]))
        writer.writeheader()
        writer.writerows(all_rows)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        out = [{"layout": lay.name, "config": lay.config, "world": lay.world,
                "overrides": list(lay.overrides), **res} for lay, res in results]  # fmt: skip
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}/table.txt, summary.md, results.csv, results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
