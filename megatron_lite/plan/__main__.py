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
from megatron_lite.plan import flags
from megatron_lite.plan.hardware import get_gpu, make_node, usable_bytes
from megatron_lite.plan.memory import plan_memory
from megatron_lite.plan.report import budget_table, layer_table, memory_table, time_table
from megatron_lite.plan.search import nearest_valid_world, override_words, search
from megatron_lite.plan.step_time import step_time
from megatron_lite.validation import validate


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, converted and checked (plan/flags.py): ConfigError on a bad one."""
    return flags.check(flags.parser(__doc__).parse_args(argv))


def world_size(args, cfg) -> int:
    if args.world is not None:
        return args.world
    if args.nodes is not None:
        return args.nodes * args.gpus_per_node
    p = cfg.parallel
    if p.dp is None:
        raise ConfigError("give --world, --nodes or parallel.dp: the planner needs a world size")
    world = p.tp * p.pp * p.cp * p.dp
    if world > flags.MAX_WORLD:
        raise ConfigError(
            f"parallel.dp={p.dp}: tp·pp·cp·dp = {world} GPUs is above the planner's "
            f"{flags.MAX_WORLD}. Fix: give --world {flags.MAX_WORLD} or fewer"
        )
    return world


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
    try:
        args = parse_args(argv)
        cfg = with_vocab(load_config(args.config, args.overrides))
        world = world_size(args, cfg)
        flags.check_world(args, world)
        gpu = node(args, _fabric(args.fabric))
        budget = usable_bytes(gpu, args.reserve)
        if not args.search:
            r = validate(cfg, world)  # reports a missing tokenizer file or mock data's vocab
        require_vocab(cfg if args.search else r)
        if not args.search:
            flags.check_run(args, r, world)
        fp8 = gpu.gpu.fp8_tflops
        print(
            f"{gpu.name}: {gpu.peak_tflops:g} TFLOP/s bf16 dense"
            + (f" ({fp8:g} FP8)" if fp8 else "")
            + f" at mfu {args.mfu:g}; {gpu.describe()}; usable {budget / 2**30:.1f} of "
            f"{gpu.memory_bytes / 2**30:.1f} GiB (3 GiB + {args.reserve:.0%} reserve)"
        )
        if args.search:
            return _search(args, cfg, world, gpu, budget)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _plan(args, r, world, gpu, budget)
    except ConfigError as e:  # an output file that could not be written (a full disk)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # --device cuda: a tensor on the wrong device
        from megatron_lite.plan.device_check import DeviceMismatch

        if not isinstance(e, DeviceMismatch):
            raise
        print(f"error: the CUDA dry run found a misplaced tensor: {e}", file=sys.stderr)
        return 1


def _fabric(path):
    """--fabric FILE's measured times (plan/fabric.py), or None; a bad file is a ConfigError
    naming the flag, the file, the field and the fix."""
    if path is None:
        return None
    from megatron_lite.plan.fabric import FabricError, load_fabric

    try:
        return load_fabric(path)
    except FabricError as e:
        raise FabricError(f"--fabric: {e}") from None


def node(args, fabric=None):
    """The hardware.Node the flags describe: the GPU in its usual node, each flag given
    replacing that part (plan/hardware.py make_node). `fabric`: measured collective times
    that replace the model's (plan/comm.py collective_time)."""
    return make_node(
        get_gpu(args.gpu), args.gpus_per_node, args.interconnect, args.nvlink_gbps,
        args.pcie_gbps, args.gpus_per_switch or 1, args.nic_gbps, args.nics_per_node,
        args.nic_type, args.ib_gbps, fabric=fabric,
    )  # fmt: skip


def _plan(args, r, world: int, gpu, budget: float) -> int:
    ranks = plan_memory(r, world, args.kernels)
    print(f"layout on {world} GPUs: " + _layout(r))
    print(layer_table(ranks[0].per_layer))
    print(memory_table(ranks, budget))
    if r.train.optimizer_offload != "none":
        from megatron_lite.plan.offload_bytes import describe

        print(describe(r))
    t = step_time(r, world, gpu, args.mfu, args.gpus_per_node)
    print(time_table(t, world))
    print(budget_table(t.budget))
    if r.model.activation_offload:
        from megatron_lite.plan.activation_offload import offload_report

        print(offload_report(r, gpu, t.layer_forward, args.pcie_gbps, args.kernels))
    if args.chart:
        _chart([(_layout(r, short=True), ranks)], budget, args.chart)
    if args.dry_run:
        from megatron_lite.plan.report import dry_run_report

        device = args.device or "cpu"
        kw = {"json_path": args.json, "kernels": args.kernels, "device": device}
        print(dry_run_report(r, world, args.ranks, args.microbatches, **kw))
    if args.measure:
        from megatron_lite.plan.measure import measure_report

        print(measure_report(r, world))
    return 0


def _chart(layouts, budget: float, path: str) -> None:
    """--chart: the PNG, written whole or not at all (plan/flags.py write_output)."""
    from megatron_lite.plan.chart import memory_chart

    flags.write_output("--chart", path, lambda tmp: memory_chart(layouts, budget, tmp))
    print(f"chart: {path}")


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
    print(
        f"searched {counts.tried} layouts of {world} GPUs: {counts.valid} valid, "
        f"{counts.fit} fit" + (f"; top {len(best)} by predicted throughput:" if best else "")
    )
    if not best:
        print(_none_found(cfg, world, args.gpus_per_node, counts, budget))
    for i, c in enumerate(best, 1):
        print(f"{i}. {c.line(cfg)}")
        print(f"   peak {c.peak_bytes / 2**30:.1f} GiB; " + time_table(c.time, world))
        if args.verify:
            print("   " + _verify(c.cfg, world, budget, args.kernels), flush=True)
    if args.chart and best:
        layouts = [(_layout(c.cfg, short=True), plan_memory(c.cfg, world)) for c in best]
        _chart(layouts, budget, args.chart)
    return 0 if best else 1


def _none_found(cfg, world: int, gpus_per_node: int, counts, budget: float) -> str:
    """Why the search found nothing: the rules that rejected layouts (counts, each with the
    message of its nearest fix) and the nearest world size with valid layouts; or, when
    layouts were valid but none fits, the smallest of their peaks."""
    if counts.valid:
        return (
            f"none fits: the smallest peak of a valid layout is "
            f"{counts.smallest_peak / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB usable "
            f"({override_words(counts.smallest, cfg)}). Fix: more GPUs (--world, --nodes), a "
            f"GPU with more memory (--gpu), or a smaller model.seq_length or model"
        )
    lines = [f"no valid layout: the {counts.tried} layouts were rejected"]
    lines += [f"  {line}" for line in counts.rejections()]
    near = nearest_valid_world(cfg, world, gpus_per_node)
    if near is not None:
        lines.append(f"Fix: one of the fixes above, or --world {near}, which has valid layouts")
    else:
        lines.append("Fix: one of the fixes above")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
