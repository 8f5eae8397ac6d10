"""python -m megatron_lite.plan --config FILE [section.key=value ...] [options]

Prints per-rank memory by term (model states per ZeRO stage and precision, activations by
schedule and recompute mode, embedding/logits/loss, working sets) and whether it fits, the
predicted step time split into compute, exposed communication and bubble; `--search` ranks
every valid layout of `--world` GPUs (`--verify`: and dry-runs the ones it prints);
`--dry-run` runs the real step of chosen ranks at full size on this CPU (fake process group and
tensors) beside the prediction; `--measure` runs one small step here beside the prediction.
"""

from __future__ import annotations

import argparse
import sys

from megatron_lite import resolve
from megatron_lite.config import Config, ConfigError, load_config
from megatron_lite.plan.hardware import GPUS, get_gpu, usable_bytes
from megatron_lite.plan.memory import plan_memory
from megatron_lite.plan.report import layer_table, memory_table, time_table
from megatron_lite.plan.search import search
from megatron_lite.plan.step_time import step_time
from megatron_lite.validation import validate


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_lite.plan", description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    world_help = "GPUs (default: --nodes × --gpus-per-node, else the config's tp·pp·cp·dp)"
    ap.add_argument("--world", type=int, default=None, help=world_help)
    ap.add_argument("--nvlink-gbps", type=float, default=None, help="GB/s per GPU per direction")
    ap.add_argument("--ib-gbps", type=float, default=None, help="GB/s per GPU per direction")
    ap.add_argument("--mfu", type=float, default=0.45, help="achievable fraction of peak")
    ap.add_argument("--reserve", type=float, default=0.05, help="fragmentation reserve fraction")
    ap.add_argument("--kernels", default="fused", choices=("fused", "torch"))
    search_help = "rank every valid layout of the world size that fits (exit 1 when none does)"
    ap.add_argument("--search", action="store_true", help=search_help)
    ap.add_argument("--top", type=int, default=5, help="layouts --search prints")
    verify_help = (
        "with --search: dry-run each printed layout (see --dry-run) and mark it confirmed when "
        "its measured peak fits, else show the measured peak"
    )
    ap.add_argument("--verify", action="store_true", help=verify_help)
    ap.add_argument("--chart", default=None, help="PNG of memory per rank by term")
    ap.add_argument("--measure", action="store_true", help="one step here beside the prediction")
    dry_help = (
        "run the real training step of chosen ranks at full size on this CPU (fake process "
        "group, fake tensors) and print its memory beside the planner's"
    )
    ap.add_argument("--dry-run", action="store_true", help=dry_help)
    ranks_help = "--dry-run's ranks, e.g. 0,8 (default: one rank per pipeline stage)"
    ap.add_argument("--ranks", default=None, help=ranks_help)
    mb_help = (
        "--dry-run's microbatches per step: steady (default: the fewest with the full step's "
        "peak, min(M, 2·pp)), all, or a count"
    )
    ap.add_argument("--microbatches", default="steady", help=mb_help)
    ap.add_argument("--json", default=None, help="write --dry-run's figures to this JSON file")
    return ap.parse_args(argv)


def world_size(args, cfg) -> int:
    if args.world:
        return args.world
    if args.nodes:
        return args.nodes * args.gpus_per_node
    p = cfg.parallel
    if p.dp is None:
        raise ConfigError("give --world, --nodes or parallel.dp: the planner needs a world size")
    return p.tp * p.pp * p.cp * p.dp


def with_vocab(cfg: Config) -> Config:
    """`cfg` with model.vocab_size filled in from the tokenizer it names (the planner runs
    before any tokenizer or data exists); left null when only the data could tell."""
    cfg.model.vocab_size = resolve.vocab_size(cfg)
    return cfg


def require_vocab(cfg: Config) -> None:
    if cfg.model.vocab_size is None:
        raise ConfigError(
            "model.vocab_size=None: the planner needs the vocabulary before any data is read, "
            "and without a tokenizer file (data.tokenizer_model) it is the data's largest token "
            "id + 1. Fix: set model.vocab_size (e.g. model.vocab_size=32000) or "
            "data.tokenizer_model"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = with_vocab(load_config(args.config, args.overrides))
        world = world_size(args, cfg)
        gpu = get_gpu(args.gpu, args.nvlink_gbps, args.ib_gbps)
        budget = usable_bytes(gpu, args.reserve)
        print(
            f"{gpu.name}: {gpu.peak_tflops:g} TFLOP/s bf16 dense at mfu {args.mfu:g}, "
            f"NVLink {gpu.nvlink_gbps:g} GB/s, IB {gpu.ib_gbps:g} GB/s per GPU, "
            f"{args.gpus_per_node} GPUs/node; usable {budget / 2**30:.1f} of "
            f"{gpu.memory_bytes / 2**30:.1f} GiB (3 GiB + {args.reserve:.0%} reserve)"
        )
        if args.search:
            require_vocab(cfg)
            return _search(args, cfg, world, gpu, budget)
        r = validate(cfg, world)  # reports a missing tokenizer file or mock data's vocab first
        require_vocab(r)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ranks = plan_memory(r, world, args.kernels)
    print(f"layout on {world} GPUs: " + _layout(r))
    print(layer_table(ranks[0].per_layer))
    print(memory_table(ranks, budget))
    print(time_table(step_time(r, world, gpu, args.mfu, args.gpus_per_node), world))
    if args.chart:
        from megatron_lite.plan.chart import memory_chart

        memory_chart([(_layout(r, short=True), ranks)], budget, args.chart)
        print(f"chart: {args.chart}")
    if args.dry_run:
        from megatron_lite.plan.dry_run import dry_run_report

        print(dry_run_report(r, world, args.ranks, args.microbatches, args.json, args.kernels))
    if args.measure:
        from megatron_lite.plan.measure import measure_report

        print(measure_report(r, world))
    return 0


def _verify(cfg, world: int, budget: float, kernels: str) -> str:
    """--verify: the layout's dry run (one rank per pipeline stage) against the budget."""
    from megatron_lite.plan.dry_run import dry_run

    results = dry_run(cfg, world, kernels=kernels)
    worst = max(results, key=lambda r: r.peak)
    where = f"rank {worst.rank} (pp {worst.coords['pp']}), in {worst.phase}"
    gib = f"{worst.peak / 2**30:.2f} GiB"
    if worst.peak <= budget:
        return f"confirmed: dry run peak {gib} at {where} fits {budget / 2**30:.2f} GiB"
    return f"does NOT fit: dry run peak {gib} at {where} > {budget / 2**30:.2f} GiB usable"


def _layout(r, short: bool = False) -> str:
    p = r.parallel
    gran = r.model.recompute_granularity or "none"
    if short:
        return (
            f"tp{p.tp}pp{p.pp}v{p.vpp}cp{p.cp}dp{p.dp}z{p.zero_stage}mb{r.train.micro_batch_size}"
        )
    return (
        f"tp{p.tp} pp{p.pp} vpp{p.vpp} cp{p.cp} ep{p.ep} dp{p.dp} zero{p.zero_stage} "
        f"mbs{r.train.micro_batch_size} recompute={gran} sp={p.sequence_parallel}"
    )


def _search(args, cfg, world, gpu, budget) -> int:
    best, counts = search(cfg, world, gpu, args.mfu, args.gpus_per_node, args.top, args.reserve)
    ranked = f"top {len(best)} by predicted throughput:"
    none = "none fits: try more GPUs (--world, --nodes) or a GPU with more memory (--gpu)"
    print(
        f"searched {counts['tried']} layouts of {world} GPUs: {counts['valid']} valid, "
        f"{counts['fit']} fit; {ranked if best else none}"
    )
    for i, c in enumerate(best, 1):
        print(f"{i}. {c.line(cfg)}")
        print(f"   peak {c.peak_bytes / 2**30:.1f} GiB; " + time_table(c.time, world))
        if args.verify:
            print("   " + _verify(c.cfg, world, budget, args.kernels), flush=True)
    if args.chart and best:
        from megatron_lite.plan.chart import memory_chart

        layouts = [(_layout(c.cfg, short=True), plan_memory(c.cfg, world)) for c in best]
        memory_chart(layouts, budget, args.chart)
        print(f"chart: {args.chart}")
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
