"""Measured pipeline timeline: wall-clock spans of one step, as a Chrome/Perfetto trace.

With train.profile_pipeline=true the engine aligns all ranks with a world barrier at the start
of each step's forward/backward, then records every forward, backward, send and recv of this
rank (`perf_counter`, seconds since that barrier; a send/recv lasts from posting its batch to
the batch completing; on CUDA each span is bracketed by `torch.cuda.synchronize()`, so it times
the GPU work rather than the kernel launches, and a profiled step runs slower). At the end of
the step all ranks' spans are gathered to rank 0 (`gather_object` over the world group) and
rank 0 rewrites `<train.out_dir>/pipeline_trace.json`, so the file always holds the latest step.
One process per global rank (pid = rank), one thread row per op kind; `otherData` carries pp,
vpp, microbatches and the step for the analysis in `summarize` (tools/pipeline_timeline.py).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from fractions import Fraction

import torch.distributed as dist

from megatron_lite.atomic import write_atomic
from megatron_lite.parallel.mappings import guarded
from megatron_lite.pipeline.schedules import (
    bubble_formula,
    get_schedule_spec,
    get_schedule_table,
    simulate_options,
)
from megatron_lite.pipeline.simulate import simulate

TRACE_FILE = "pipeline_trace.json"
ROWS = ("compute", "send_forward", "recv_forward", "send_backward", "recv_backward")


class SpanRecorder:
    """Spans (kind, microbatch, chunk, start, end) of one rank, seconds since `t0`."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.spans: list[tuple[str, int, int, float, float]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, kind: str, microbatch: int, chunk: int, start: float, end: float) -> None:
        self.spans.append((kind, microbatch, chunk, start, end))


def chrome_events(rank: int, pp_rank: int, spans: list[tuple]) -> list[dict]:
    """Chrome trace events of one rank: a process named after it, one row per op kind."""
    events = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": rank,
            "args": {"name": f"rank {rank} (pp {pp_rank})"},
        },
        {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}},
    ]
    for tid, row in enumerate(ROWS):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": row}}
        )
    for kind, mb, chunk, start, end in spans:
        row = "compute" if kind in ("forward", "backward", "weight") else kind
        events.append(
            {
                "name": f"{kind} mb{mb} c{chunk}",
                "cat": kind,
                "ph": "X",
                "pid": rank,
                "tid": ROWS.index(row),
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": {"microbatch": mb, "chunk": chunk, "pp_rank": pp_rank},
            }
        )
    return events


def write_trace(recorder: SpanRecorder, pp_rank: int, meta: dict, out_dir: str) -> str | None:
    """Gather every rank's spans to rank 0 (world group) and write the trace there.

    Returns the path on rank 0, None elsewhere. A collective: every rank must call it.
    """
    mine = (dist.get_rank(), pp_rank, recorder.spans)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    guarded("trace gather", None, lambda: dist.gather_object(mine, gathered, dst=0))
    if gathered is None:
        return None
    events = [e for rank, pp, spans in gathered for e in chrome_events(rank, pp, spans)]
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, TRACE_FILE)
    write_atomic(path, json.dumps(trace))  # readers never see a half-written file
    return path


def summarize(trace: dict) -> dict:
    """Busy/idle per rank and the bubble (idle / busy, as in simulate.py) of a measured trace.

    The step window is [0, latest span end over all ranks]; busy = forward + backward time;
    idle = window - busy (p2p waits and gaps). `predicted` simulates the same schedule with unit
    costs 1:2 (no comm cost; `formula`: the schedule record's closed form there, if it has one,
    `formula_rule` its text) and with this trace's mean forward/backward durations
    plus the shortest p2p batch as comm cost (a batch whose peer is ready costs only transfer).
    """
    busy: dict[int, float] = defaultdict(float)
    cost: dict[str, list[float]] = defaultdict(list)
    window, pp_of, batches = 0.0, {}, set()
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        pid, dur = e["pid"], e["dur"] / 1e6
        pp_of[pid] = e["args"]["pp_rank"]
        window = max(window, (e["ts"] + e["dur"]) / 1e6)
        if e["cat"] in ("forward", "backward", "weight"):
            busy[pid] += dur
            cost[e["cat"]].append(dur)
        else:  # the ops of one batch share their start and end
            batches.add((pid, e["ts"], dur))
    ranks = sorted(pp_of)
    idle = {r: window - busy[r] for r in ranks}
    total_busy = sum(busy[r] for r in ranks)
    meta = trace.get("otherData", {})
    pp, vpp, m = meta.get("pp"), meta.get("vpp", 1), meta.get("num_microbatches")
    schedule = meta.get("schedule")
    predicted = {}
    if pp and m:
        table = get_schedule_table(pp, m, vpp, schedule)
        how = simulate_options(schedule, vpp)
        formula = bubble_formula(schedule, pp, vpp, m, Fraction(1), Fraction(2))
        if formula is not None:  # the record's closed form at the unit costs
            predicted["formula"] = float(formula)
            predicted["formula_rule"] = get_schedule_spec(schedule, vpp).bubble_rule
        predicted["unit_costs"] = float(simulate(table, **how).bubble_fraction)
        if cost["forward"] and cost["backward"]:
            fwd = sum(cost["forward"]) / len(cost["forward"])
            bwd = sum(cost["backward"]) / len(cost["backward"])
            wgt = sum(cost["weight"]) / len(cost["weight"]) if cost["weight"] else 0.0
            comm = min((dur for *_, dur in batches), default=0.0)
            sim = simulate(table, fwd, bwd + wgt, comm, weight_cost=wgt, **how)
            predicted["measured_costs"] = float(sim.bubble_fraction)
            ms = {"forward": fwd * 1e3, "backward": bwd * 1e3, "weight": wgt * 1e3,
                  "comm": comm * 1e3}  # fmt: skip
            predicted["costs_ms"] = ms
    return {
        "window_s": window,
        "ranks": {
            r: {
                "pp_rank": pp_of[r],
                "busy_s": busy[r],
                "idle_s": idle[r],
                "bubble": idle[r] / busy[r] if busy[r] else 0.0,
            }
            for r in ranks
        },
        "bubble": sum(idle.values()) / total_busy if total_busy else 0.0,
        "predicted": predicted,
        "meta": meta,
    }
