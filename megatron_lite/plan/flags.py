"""The planner's command line: every flag is read as text and checked before any work, so a bad
value or a conflicting pair of flags is one line naming the flag, the rule and a fix (exit 2).

The numeric rules are the table `NUMERIC`; the pairs of flags that only work together, or not
at all together, are `NEEDS` and `EXCLUSIVE`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from megatron_lite.plan.errors import flag_error
from megatron_lite.plan.hardware import GPUS
from megatron_lite.plan.node_flags import check_node, node_arguments
from megatron_lite.validation.paths import output_dir_problem

# The planner's rank grid and its link model cost O(world) per layout: 2^20 GPUs (a million,
# several times today's largest clusters) plans in seconds, a search in under a minute.
MAX_WORLD = 1 << 20
MAX_GBPS = 10_000.0  # GB/s per GPU per direction: 10x NVLink 5; larger is a unit slip
MAX_NIC_GBPS = 3_200.0  # Gb/s line rate of one NIC: 2x today's fastest (1.6 Tb/s)
MAX_NICS = 64  # NICs per node
MEASURE_MAX_WORLD = 64  # --measure forks one process per rank on this machine
MAX_VERIFY = 16  # --search --verify dry-runs each printed layout: --top at most this many
# The most ranks one dry run takes: each is a dry run of its own (seconds to minutes for a
# full-size stage); ranks of one pipeline stage hold the same shapes, so one per stage (the
# default) is the useful set.
MAX_DRY_RUN_RANKS = 64


@dataclass(frozen=True)
class Bound:
    """A numeric flag's rule: an int or a finite float in [lo, hi] (either end may be open)."""

    kind: type
    lo: float
    hi: float
    fix: str
    lo_open: bool = False
    hi_open: bool = False
    fraction: bool = False  # a share of 1: a value in (1, 100] is probably a percentage

    def text(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        if self.hi == math.inf:
            return f"must be {what} {'>' if self.lo_open else '>='} {_num(self.lo)}"
        lo, hi = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"must be {what} in {lo}{_num(self.lo)}, {_num(self.hi)}{hi}"

    def holds(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return math.isfinite(v) and above and below


NUMERIC = {
    "--world": Bound(int, 1, MAX_WORLD, "give the GPUs in all, e.g. --world 64"),
    "--nodes": Bound(int, 1, MAX_WORLD, "give the node count, e.g. --nodes 8"),
    "--gpus-per-node": Bound(
        int, 1, MAX_WORLD, "give the GPUs of one NVLink domain, e.g. --gpus-per-node 8"
    ),
    "--nvlink-gbps": Bound(
        float, 0, MAX_GBPS, "GB/s per GPU per direction, e.g. --nvlink-gbps 450 (H100)", True
    ),
    "--ib-gbps": Bound(
        float, 0, MAX_GBPS, "GB/s per GPU per direction, e.g. --ib-gbps 50 (400 Gb/s)", True
    ),
    "--pcie-gbps": Bound(
        float, 0, MAX_GBPS, "GB/s per GPU per direction, e.g. --pcie-gbps 50 (Gen5 x16)", True
    ),
    "--gpus-per-switch": Bound(
        int, 1, MAX_WORLD, "GPUs sharing one PCIe switch uplink, e.g. --gpus-per-switch 2"
    ),
    "--nic-gbps": Bound(
        float, 0, MAX_NIC_GBPS, "Gb/s line rate of one NIC, e.g. --nic-gbps 200", True
    ),
    "--nics-per-node": Bound(int, 1, MAX_NICS, "NICs per node, e.g. --nics-per-node 8"),
    "--mfu": Bound(float, 0, 1, "a fraction of peak, e.g. --mfu 0.45", True, fraction=True),
    "--reserve": Bound(
        float, 0, 1, "a fraction of memory, e.g. --reserve 0.05", hi_open=True, fraction=True
    ),
    "--top": Bound(int, 1, math.inf, "e.g. --top 5"),
}
# (flag, the flag it needs): each is ignored without the other
NEEDS = [
    ("--verify", "--search"),
    ("--top", "--search"),
    ("--ranks", "--dry-run"),
    ("--microbatches", "--dry-run"),
    ("--json", "--dry-run"),
    ("--device", "--dry-run"),
]
# (flag, flag, rule, fix): flags that do not go together
_SEARCH = "the search stops after its ranking"
_IB = "--ib-gbps is each GPU's share of the NICs already (efficiency included)"
EXCLUSIVE = [
    ("--search", "--dry-run", _SEARCH,
     "use --search --verify to dry-run the layouts the search prints"),
    ("--search", "--measure", _SEARCH, "run --measure on one of the layouts the search prints"),
    ("--ib-gbps", "--nic-gbps", _IB,
     "give --nic-gbps (and --nics-per-node, --nic-type), or --ib-gbps"),
    ("--ib-gbps", "--nics-per-node", _IB, "give --nic-gbps and --nics-per-node, or --ib-gbps"),
    ("--ib-gbps", "--nic-type", _IB, "give --nic-gbps and --nic-type, or --ib-gbps"),
]  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a missing value, a bad choice) as one line."""

    def error(self, message: str):
        print(f"error: {message}. Fix: see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m megatron_lite.plan", description=doc)
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--nodes", default=None)
    ap.add_argument("--gpus-per-node", default="8")
    node_arguments(ap)
    world_help = "GPUs (default: --nodes × --gpus-per-node, else the config's tp·pp·cp·dp)"
    ap.add_argument("--world", default=None, help=world_help)
    ap.add_argument("--nvlink-gbps", default=None, help="GB/s per GPU per direction")
    ib_help = "GB/s per GPU per direction between nodes (its share of the NICs, all efficiency in)"
    ap.add_argument("--ib-gbps", default=None, help=ib_help)
    ap.add_argument("--mfu", default="0.45", help="achievable fraction of peak")
    ap.add_argument("--reserve", default="0.05", help="fragmentation reserve fraction")
    ap.add_argument("--kernels", default="fused", choices=("fused", "torch"))
    search_help = "rank every valid layout of the world size that fits (exit 1 when none does)"
    ap.add_argument("--search", action="store_true", help=search_help)
    ap.add_argument("--top", default=None, help="layouts --search prints (default 5)")
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
    ap.add_argument("--microbatches", default=None, help=mb_help)
    ap.add_argument("--json", default=None, help="write --dry-run's figures to this JSON file")
    fabric_help = (
        "a fabric file of tools/bench_comm.py: its measured collective times replace the "
        "model's where it has them (docs/bench_comm.md)"
    )
    ap.add_argument("--fabric", default=None, help=fabric_help)
    device_help = "--dry-run's device: cpu (default), or cuda (docs/cuda_dry_run.md)"
    ap.add_argument("--device", default=None, choices=("cpu", "cuda"), help=device_help)
    return ap


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# ASCII only: int() and float() also take "１２", "١٢", "1_000" and surrounding spaces
_INT = re.compile(r"[+-]?[0-9]{1,18}")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _number(flag: str, text: str, b: Bound):
    v = None
    if (_INT if b.kind is int else _FLOAT).fullmatch(text):
        try:
            v = b.kind(text)
        except (ValueError, OverflowError):
            v = None
    if v is None or not b.holds(v):
        fix = b.fix
        if b.fraction and v is not None and 1 < v <= 100:
            fix += f" ({v:g}% is {v / 100:g})"
        flag_error(flag, text, b.text(), fix)
    return v


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, flag[2:].replace("-", "_"))
    return value not in (None, False)


def _output_file(flag: str, path: str, example: str) -> None:
    """`path` can be written, which plan/flags.py finds out before any work: not a directory,
    a broken link or a device, and its directory (existing: the planner creates none) takes a
    new file (a probe file is created and removed: os.access says yes to root on /proc)."""
    fix = f"give a file in an existing writable directory, e.g. {flag} {example}"
    problem = output_file_problem(path)
    if problem is not None:
        flag_error(flag, path, problem, fix)


def output_file_problem(path: str) -> str | None:
    """Why the file `path` cannot be written, or None."""
    if path == "" or path.endswith(os.sep) or os.path.isdir(path):
        return "is a directory, not a file" if path else "is empty"
    if os.path.islink(path) and not os.path.exists(path):
        return f"is a broken symbolic link (to {os.readlink(path)})"
    target = os.path.realpath(path)
    if os.path.exists(target):
        mode = os.stat(target).st_mode
        if not stat.S_ISREG(mode):
            return "is not a regular file (a device, pipe or socket)"
        if not os.access(target, os.W_OK):
            return "exists and is not writable by this user"
    parent = os.path.dirname(target)
    problem = output_dir_problem(parent, os.path.basename(target))
    if problem is None and not os.path.isdir(parent):
        problem = "does not exist"
    if problem is None:
        try:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(target)}.")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            problem = f"does not take a new file ({e.strerror})"
    return None if problem is None else f"its directory {parent} {problem}"


def write_output(flag: str, path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes the whole output into a temporary sibling of `path`, which then
    replaces `path` at once (a link: its target): a full disk leaves the old file as it was
    and is one line naming `flag` (ConfigError), not a traceback after the work."""
    target = os.path.realpath(path)
    name, ext = os.path.basename(target), os.path.splitext(target)[1]
    mode = os.stat(target).st_mode & 0o777 if os.path.exists(target) else 0o666 & ~_umask()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{name}.", suffix=ext)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        flag_error(
            flag,
            path,
            f"could not be written ({e.strerror or e})",
            "free space on its file system, or give another file",
        )
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check(args: argparse.Namespace) -> argparse.Namespace:
    """The flags converted and checked (ConfigError naming the flag, the rule and a fix): the
    numbers by `NUMERIC`, then the pairs, then the output files. Changes `args` in place."""
    for flag, bound in NUMERIC.items():
        name = flag[2:].replace("-", "_")
        text = getattr(args, name)
        if text is not None:
            setattr(args, name, _number(flag, text, bound))
    for flag, needed in NEEDS:
        if _given(args, flag) and not _given(args, needed):
            value = getattr(args, flag[2:])
            flag_error(
                flag,
                None if value is True else value,
                f"only applies with {needed}",
                f"add {needed}, or drop {flag}",
            )
    for a, b, rule, fix in EXCLUSIVE:
        if _given(args, a) and _given(args, b):
            flag_error(f"{a} with {b}", None, rule, fix)
    if args.nodes is not None and args.nodes * args.gpus_per_node > MAX_WORLD:
        flag_error(
            "--nodes",
            args.nodes,
            f"× --gpus-per-node {args.gpus_per_node} is above {MAX_WORLD} GPUs",
            f"plan {MAX_WORLD} GPUs or fewer",
        )
    if args.world is not None and args.nodes is not None:
        if args.world != args.nodes * args.gpus_per_node:
            flag_error(
                "--world",
                args.world,
                f"disagrees with --nodes {args.nodes} × "
                f"--gpus-per-node {args.gpus_per_node} = {args.nodes * args.gpus_per_node}",
                "give --world or --nodes, not both",
            )
    check_node(args)
    if args.microbatches is None:  # a given one is checked against the layout: check_run
        args.microbatches = "steady"
    if args.verify and args.top is not None and args.top > MAX_VERIFY:
        flag_error(
            "--top",
            args.top,
            f"with --verify dry-runs each printed layout (one rank per "
            f"pipeline stage, minutes for a full-size model), at most {MAX_VERIFY}",
            f"--top {MAX_VERIFY} or fewer",
        )
    args.top = 5 if args.top is None else args.top
    if args.chart is not None:
        if not args.chart.lower().endswith(".png"):
            flag_error("--chart", args.chart, "must name a .png file", "e.g. --chart memory.png")
        _output_file("--chart", args.chart, "memory.png")
    if args.json is not None:
        _output_file("--json", args.json, "dry_run.json")
    return args


def parse_ranks(text: str | None, world: int) -> list[int] | None:
    """--ranks "0,8,16" -> [0, 8, 16]; None -> None (the default: default_ranks). ConfigError
    naming --ranks unless each is ASCII digits, in [0, world), none twice, at most
    MAX_DRY_RUN_RANKS of them."""
    if text is None:
        return None
    words = [w.strip() for w in text.split(",")]
    ranks = [int(w) for w in words if re.fullmatch(r"[0-9]{1,18}", w)]
    example = "e.g. --ranks 0" + (f",{world - 1}" if world > 1 else "")
    if len(ranks) != len(words) or any(r >= world for r in ranks):
        rule = f"must be comma-separated ranks (ASCII digits) in [0, {world})"
        flag_error("--ranks", text, rule, example)
    if len(set(ranks)) != len(ranks):
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        flag_error("--ranks", text, f"names rank {twice[0]} twice", "give each rank once")
    if len(ranks) > MAX_DRY_RUN_RANKS:
        flag_error(
            "--ranks",
            text,
            f"names {len(ranks)} ranks; the dry run takes at most {MAX_DRY_RUN_RANKS} (each "
            "rank is a dry run of its own, and the ranks of one pipeline stage hold the same "
            "shapes)",
            "leave --ranks out (one rank per pipeline stage), or name fewer",
        )
    return ranks


def check_world(args: argparse.Namespace, world: int) -> None:
    """The rules that need the world size, which may be the config's tp·pp·cp·dp: --measure's
    process count and --ranks (parse_ranks)."""
    if args.ranks is not None:
        parse_ranks(args.ranks, world)
    if world > MAX_WORLD:  # --world and --nodes were checked: the config's layout
        flag_error(
            "parallel.dp",
            world,
            f"gives tp·pp·cp·dp = {world} GPUs, above the planner's {MAX_WORLD}",
            "plan a smaller layout, or give --world",
        )
    if args.measure and world > MEASURE_MAX_WORLD:
        flag_error(
            "--measure",
            f"{world} ranks",
            f"forks one process per rank on this machine, at most {MEASURE_MAX_WORLD}",
            "use --dry-run, which runs chosen ranks of any world size",
        )


def check_run(args: argparse.Namespace, cfg, world: int) -> None:
    """The flags checked against the run they drive (`cfg`: the validated, resolved config),
    before any of it: --microbatches against the pipeline schedule and the config's M
    (plan/dry_run.py dry_run_microbatches) and --measure's real memory against this machine's."""
    if args.dry_run:
        from megatron_lite.plan.dry_run import dry_run_microbatches

        dry_run_microbatches(cfg, args.microbatches)
    if args.measure:
        need, have = _measure_bytes(cfg, world), _host_available_bytes()
        if have is not None and need > have:
            flag_error(
                "--measure",
                None,
                f"allocates the layout's real memory here: the planner "
                f"predicts {need / 2**30:.1f} GiB over {world} ranks for its one-microbatch "
                f"step, and this machine has {have / 2**30:.1f} GiB available",
                "use --dry-run (fake tensors, no memory), or a smaller model",
            )


def _measure_bytes(cfg, world: int) -> float:
    """The planner's bytes of --measure's step (plan/measure.py one_step_config) over all
    ranks: each stage's prediction times the ranks per stage."""
    from megatron_lite.plan.measure import one_step_config
    from megatron_lite.plan.memory import rank_memory

    run_cfg = one_step_config(cfg, "")
    pp = run_cfg.parallel.pp
    per_stage = world // pp
    return sum(rank_memory(run_cfg, world, k, "torch").total for k in range(pp)) * per_stage


def _host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None (not checked)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
