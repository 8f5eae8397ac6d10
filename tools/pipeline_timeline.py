"""Per-rank busy/idle time and the measured pipeline bubble of a pipeline_trace.json.

    python -m megatron_lite.train ... parallel.pp=4 train.profile_pipeline=true
    python tools/pipeline_timeline.py runs/default/pipeline_trace.json

The trace (written by the engine under train.profile_pipeline=true, one step, all ranks) opens in
Perfetto (ui.perfetto.dev) as is. Busy = forward + backward time; idle = the step window minus
busy (p2p waits and gaps); bubble = idle / busy, the definition of pipeline/simulate.py, whose
prediction for the same schedule is printed alongside: with unit costs forward=1, backward=2
and free communication (with the schedule's closed form where its record has one: (pp-1)/(vpp*m)
for 1F1B and interleaved), and with this trace's mean forward and
backward durations plus its shortest p2p batch as the cost of every batch.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_lite.pipeline.trace import summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="pipeline_trace.json from a run's train.out_dir")
    args = parser.parse_args(argv)
    try:
        with open(args.trace) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        print(f"error: cannot read {args.trace}: {err}", file=sys.stderr)
        return 2
    s = summarize(trace)
    if not s["ranks"]:
        print(f"error: {args.trace} has no spans", file=sys.stderr)
        return 2
    meta = s["meta"]
    print(
        f"step {meta.get('step')}: pp={meta.get('pp')} vpp={meta.get('vpp')} "
        f"m={meta.get('num_microbatches')} microbatches, window {s['window_s'] * 1e3:.2f} ms"
    )
    print(f"{'rank':>4} {'pp':>3} {'busy ms':>9} {'idle ms':>9} {'bubble':>8}")
    for rank, r in s["ranks"].items():
        print(
            f"{rank:>4} {r['pp_rank']:>3} {r['busy_s'] * 1e3:>9.2f} {r['idle_s'] * 1e3:>9.2f} "
            f"{r['bubble']:>8.4f}"
        )
    print(f"measured bubble (idle/busy)         {s['bubble']:.4f}")
    pred = s["predicted"]
    if "measured_costs" in pred:
        c = pred["costs_ms"]
        print(
            f"simulated, measured costs           {pred['measured_costs']:.4f}  (F "
            f"{c['forward']:.2f} ms, B {c['backward']:.2f} ms, W {c.get('weight', 0.0):.2f} ms, "
            f"p2p batch {c['comm']:.2f} ms)"
        )
    if "unit_costs" in pred:
        rule = pred.get("formula_rule", "(pp-1)/(vpp*m)")  # the schedule record's closed form
        formula = f"  = formula {rule} = {pred['formula']:.4f}" if "formula" in pred else ""
        print(f"simulated, F=1 B=2, no comm cost    {pred['unit_costs']:.4f}{formula}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
