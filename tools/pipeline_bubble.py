"""Print the simulated pipeline bubble and peak activations of a schedule.

    python tools/pipeline_bubble.py --pp 4 --vpp 2 --microbatches 8
    python tools/pipeline_bubble.py --pp 4 --microbatches 8 --print-schedule --trace trace.json
    python tools/pipeline_bubble.py --pp 4 -m 8 --schedule zb-h1 --weight-cost 1

Costs are per chunk action (a chunk holds 1/vpp of a rank's layers); --backward-cost is a whole
backward, of which the zero-bubble schedules' W takes --weight-cost (default half). The formula
line is the schedule record's closed form where it has one (pipeline/registry.py
`bubble_formula`): the Megatron paper's (pp-1)/(vpp*m) for 1F1B and interleaved (exact for
forward=1, backward=2, comm=0) and Qi et al.'s (pp-1)(F+B-W)/(m(F+B+W)) for ZB-H1 (B: the
input-grad part).
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

from megatron_lite.pipeline.schedules import (
    bubble_formula,
    format_actions,
    get_schedule_spec,
    get_schedule_table,
    schedule_names,
    simulate_options,
)
from megatron_lite.pipeline.simulate import chrome_trace, simulate


def _number(text: str) -> Fraction | float:
    """Exact for integers and fractions like 1/3, float otherwise."""
    try:
        return Fraction(text)
    except ValueError:
        return float(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaved)")
    parser.add_argument("--microbatches", "-m", type=int, required=True)
    parser.add_argument("--forward-cost", type=_number, default=Fraction(1))
    parser.add_argument("--backward-cost", type=_number, default=Fraction(2))
    parser.add_argument("--comm-cost", type=_number, default=Fraction(0))
    parser.add_argument(
        "--weight-cost",
        type=_number,
        default=None,
        help="W's part of --backward-cost (zero-bubble schedules; default half)",
    )
    parser.add_argument("--schedule", default=None, choices=sorted(schedule_names()),
                        help="default: 1f1b, or interleaved with --vpp > 1")  # fmt: skip
    parser.add_argument("--print-schedule", action="store_true", help="print every rank's actions")
    parser.add_argument("--trace", help="write a Chrome/Perfetto trace JSON to this path")
    args = parser.parse_args(argv)

    try:
        table = get_schedule_table(args.pp, args.microbatches, args.vpp, args.schedule)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    spec = get_schedule_spec(args.schedule, args.vpp)
    how = simulate_options(spec.name, args.vpp)
    costs = (args.forward_cost, args.backward_cost, args.comm_cost)
    result = simulate(table, *costs, weight_cost=args.weight_cost, **how)

    if args.print_schedule:
        for rank, actions in enumerate(table):
            print(f"rank {rank}: {format_actions(actions)}")
        print()
    print(f"{'rank':>4} {'peak activations':>16} {'busy':>8} {'idle':>8} {'bubble':>8}")
    for rank in range(args.pp):
        print(
            f"{rank:>4} {result.peak_in_flight[rank]:>16} {float(result.busy[rank]):>8.3g} "
            f"{float(result.idle[rank]):>8.3g} {float(result.bubble_per_rank[rank]):>8.4f}"
        )
    print(f"makespan {float(result.makespan):.4g}")
    print(f"bubble   {result.bubble_fraction} = {float(result.bubble_fraction):.4f} (simulated)")
    formula = bubble_formula(spec.name, args.pp, args.vpp, args.microbatches, *costs[:2],
                             args.weight_cost)  # fmt: skip
    if formula is not None:
        print(f"formula  {formula} = {float(formula):.4f} ({spec.bubble_rule})")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(list(result.spans)), f)
        print(f"trace written to {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
