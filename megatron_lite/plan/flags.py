"""The planner's command line: every flag is read as text and checked before any work, so a bad
value or a conflicting pair of flags is one line naming the flag, the rule and a fix (exit 2).

The numeric rules are the table `NUMERIC`; the pairs of flags that only work together, or not
at all together, are `NEEDS` and `EXCLUSIVE`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

from megatron_lite.config import ConfigError
from megatron_lite.plan.hardware import GPUS
from megatron_lite.validation.paths import output_dir_problem

# The planner's rank grid and its link model cost O(world) per layout: 2^20 GPUs (a million,
# several times today's largest clusters) plans in seconds, a search in under a minute.
MAX_WORLD = 1 << 20
MAX_GBPS = 10_000.0  # GB/s per GPU per direction: 10x NVLink 5; larger is a unit slip
MEASURE_MAX_WORLD = 64  # --measure forks one process per rank on this machine


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
]
# (flag, flag, fix): --search prints a ranking and stops, the other would never run
EXCLUSIVE = [
    ("--search", "--dry-run", "use --search --verify to dry-run the layouts the search prints"),
    ("--search", "--measure", "run --measure on one of the layouts the search prints"),
]


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
    world_help = "GPUs (default: --nodes × --gpus-per-node, else the config's tp·pp·cp·dp)"
    ap.add_argument("--world", default=None, help=world_help)
    ap.add_argument("--nvlink-gbps", default=None, help="GB/s per GPU per direction")
    ap.add_argument("--ib-gbps", default=None, help="GB/s per GPU per direction")
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
    return ap


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _shown(text: str) -> str:
    return text if text and text.strip() == text else repr(text)


def _fail(flag: str, text, rule: str, fix: str):
    """ConfigError "flag=value: rule. Fix: fix" (a switch, value None: "flag: rule. ...")."""
    shown = "" if text is None else f"={_shown(str(text))}"
    raise ConfigError(f"{flag}{shown}: {rule}. Fix: {fix}")


def _number(flag: str, text: str, b: Bound):
    try:
        v = b.kind(text)
    except (ValueError, OverflowError):
        v = None
    if v is None or not b.holds(v):
        fix = b.fix
        if b.fraction and v is not None and 1 < v <= 100:
            fix += f" ({v:g}% is {v / 100:g})"
        _fail(flag, text, b.text(), fix)
    return v


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, flag[2:].replace("-", "_"))
    return value not in (None, False)


def _output_file(flag: str, path: str, example: str) -> None:
    """`path` can be written: not a directory, in an existing directory this user can write
    (the planner creates no directories)."""
    fix = f"give a file in an existing writable directory, e.g. {flag} {example}"
    if path == "" or os.path.isdir(path) or path.endswith(os.sep):
        _fail(flag, path, "is a directory, not a file" if path else "is empty", fix)
    parent = os.path.dirname(os.path.abspath(path))
    problem = output_dir_problem(parent, os.path.basename(path))
    if problem is None and not os.path.isdir(parent):
        problem = "does not exist"
    if problem is not None:
        _fail(flag, path, f"its directory {parent} {problem}", fix)


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
            _fail(flag, None if value is True else value, f"only applies with {needed}",
                  f"add {needed}, or drop {flag}")  # fmt: skip
    for a, b, fix in EXCLUSIVE:
        if _given(args, a) and _given(args, b):
            _fail(f"{a} with {b}", None, "the search stops after its ranking", fix)
    if args.nodes is not None and args.nodes * args.gpus_per_node > MAX_WORLD:
        _fail("--nodes", args.nodes, f"× --gpus-per-node {args.gpus_per_node} is above "
              f"{MAX_WORLD} GPUs", f"plan {MAX_WORLD} GPUs or fewer")  # fmt: skip
    if args.world is not None and args.nodes is not None:
        if args.world != args.nodes * args.gpus_per_node:
            _fail("--world", args.world, f"disagrees with --nodes {args.nodes} × "
                  f"--gpus-per-node {args.gpus_per_node} = {args.nodes * args.gpus_per_node}",
                  "give --world or --nodes, not both")  # fmt: skip
    mb = args.microbatches
    if mb is not None and mb not in ("steady", "all") and not (mb.isdigit() and int(mb) >= 1):
        _fail("--microbatches", mb, "must be steady, all or a count >= 1", "e.g. --microbatches 8")
    args.microbatches = mb or "steady"
    args.top = 5 if args.top is None else args.top
    if args.chart is not None:
        if not args.chart.lower().endswith(".png"):
            _fail("--chart", args.chart, "must name a .png file", "e.g. --chart memory.png")
        _output_file("--chart", args.chart, "memory.png")
    if args.json is not None:
        _output_file("--json", args.json, "dry_run.json")
    return args


def check_world(args: argparse.Namespace, world: int) -> None:
    """The rules that need the world size, which may be the config's tp·pp·cp·dp: --measure's
    process count and --ranks (comma-separated, each in [0, world), none twice)."""
    if args.ranks is not None:
        words = args.ranks.split(",")
        ranks = [int(w) for w in words if w.strip().isdigit()]
        if len(ranks) != len(words) or len(set(ranks)) != len(ranks) or max(ranks) >= world:
            _fail("--ranks", args.ranks, f"must be distinct comma-separated ranks in [0, {world})",
                  "e.g. --ranks 0" + (f",{world - 1}" if world > 1 else ""))  # fmt: skip
    if world > MAX_WORLD:  # --world and --nodes were checked: the config's layout
        _fail("parallel.dp", world, f"gives tp·pp·cp·dp = {world} GPUs, above the planner's "
              f"{MAX_WORLD}", "plan a smaller layout, or give --world")  # fmt: skip
    if args.measure and world > MEASURE_MAX_WORLD:
        _fail("--measure", f"{world} ranks", f"forks one process per rank on this machine, at "
              f"most {MEASURE_MAX_WORLD}", "use --dry-run, which runs chosen ranks of any "
              "world size")  # fmt: skip
