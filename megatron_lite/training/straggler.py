"""Straggler detection (log.straggler): which ranks compute slower than their peers.

Each rank times its own compute per step, excluding the time it waits inside collectives
(a fast rank waits there for the slow one, so wall time would make every rank look as slow as
the slowest):

- CPU: the training thread's CPU time (`time.thread_time`). A rank blocked in a gloo
  collective sleeps on a condition variable while gloo's own threads move the data: measured
  here, a 1 s wait for a peer cost the waiting thread 0.3 ms of CPU time, so nothing needs
  subtracting. With more than one intra-op thread the pool's other threads are not counted;
  the training thread's share still scales with the rank's speed.
- CUDA: a pair of CUDA events around the step on the current stream, minus an event pair
  around each blocking collective (comm_stats.CommStats.wait_timer, run by mappings' guard):
  the time the compute stream stalled inside collectives (one issued on a side stream is not
  timed). Waits on async handles (overlapped gradient reduction) are not subtracted.

Every `interval` steps one all-gather of three floats per rank (pipeline stage, mean compute
seconds per step over the interval, steps counted) and, once, of the host names lets every
rank see everyone's times; rank 0 reports them. A rank's relative speed is the median compute
time of its peers over its own (1.0: as fast as the median; 0.5: half as fast); its peers are
the ranks of its pipeline stage (stages do different work: embedding, loss), or the world
when its stage has one rank. The record gets `straggler/min_rel` and `straggler/slowest_ranks`
(the `top` slowest: rank, host, relative speed, slowest first).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time

import torch
import torch.distributed as dist

from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.comm_stats import STATS


class StragglerDetector:
    """Per-rank compute timing and the periodic report (module docstring). Call `start` and
    `stop` around each step's compute on every rank, then `report(step)` on every rank (a
    collective every `interval` steps) -> the record's straggler/* fields ({} between)."""

    def __init__(self, interval: int, device: torch.device, pp_rank: int, top: int = 3):
        self.interval, self.device, self.pp_rank, self.top = interval, device, pp_rank, top
        self.cuda = device.type == "cuda"
        self.total_s, self.steps = 0.0, 0  # this rank's compute over the interval so far
        self.hosts: list[str] | None = None  # every rank's host name, gathered at the first report
        self._t0 = 0.0
        self._stream = None  # CUDA: the stream the step runs on
        self._events: list[tuple] = []  # CUDA: (start, end, [(start, end) per collective])
        self._waits: list[tuple] = []  # CUDA: the current step's collectives' event pairs

    def start(self) -> None:
        """Before the step's compute."""
        if not self.cuda:
            self._t0 = time.thread_time()
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self._stream = torch.cuda.current_stream()
        self._waits = []
        self._events.append((start, None, self._waits))
        STATS.wait_timer = self._collective_wait

    def stop(self) -> None:
        """After the step's compute (its optimizer step included)."""
        self.steps += 1
        if not self.cuda:
            self.total_s += time.thread_time() - self._t0
            return
        STATS.wait_timer = None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        start, _, waits = self._events[-1]
        self._events[-1] = (start, end, waits)

    @contextlib.contextmanager
    def _collective_wait(self):
        """An event pair around one blocking collective on the step's stream (CUDA); one
        issued on a side stream (overlapped communication) did not stall it: not timed."""
        if torch.cuda.current_stream() != self._stream:
            yield
            return
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record()
        try:
            yield
        finally:
            pair[1].record()
            self._waits.append(pair)

    def _cuda_total(self) -> float:
        """The interval's compute seconds from its events (waits for the last one)."""
        total = 0.0
        for start, end, waits in self._events:
            end.synchronize()
            stalled = sum(a.elapsed_time(b) for a, b in waits)
            total += max(start.elapsed_time(end) - stalled, 0.0) / 1000
        self._events = []
        return total

    def report(self, step: int) -> dict:
        """After (0-based) `step`: every `interval` steps the gathered report (a collective on
        every rank), else {}."""
        if (step + 1) % self.interval != 0:
            return {}
        if self.cuda:
            self.total_s = self._cuda_total()
        mine = [float(self.pp_rank), self.total_s / max(self.steps, 1), float(self.steps)]
        self.total_s, self.steps = 0.0, 0
        if self.hosts is None:
            self.hosts = [""] * dist.get_world_size()
            name = socket.gethostname()
            mappings.guarded(
                "all_gather_object", None,
                lambda: mappings.all_gather_objects(self.hosts, name, dist.group.WORLD),
            )  # fmt: skip
        t = torch.tensor(mine, dtype=torch.float64, device=self.device)
        rows = mappings.all_gather_dim0(t.reshape(1, 3), dist.group.WORLD, kind="straggler")
        table = host.read(rows, [mine] * dist.get_world_size())
        return straggler_fields(table, self.hosts, self.top)


def relative_speeds(stages: list[int], seconds: list[float]) -> list[float]:
    """Per rank: the median compute time of the ranks of its pipeline stage (of the world when
    it is alone in its stage) over its own time; 1.0 for a rank that measured nothing."""
    out = []
    for stage, own in zip(stages, seconds, strict=True):
        peers = [s for st, s in zip(stages, seconds, strict=True) if st == stage]
        if len(peers) < 2:
            peers = seconds
        out.append(statistics.median(peers) / own if own > 0 else 1.0)
    return out


def straggler_fields(table: list[list[float]], hosts: list[str], top: int) -> dict:
    """The record's straggler/* fields from the gathered [pipeline stage, mean compute s,
    steps] of every rank (in rank order) and their hosts."""
    rel = relative_speeds([int(r[0]) for r in table], [r[1] for r in table])
    slowest = sorted(range(len(rel)), key=lambda r: (rel[r], r))[:top]
    return {
        "straggler/min_rel": min(rel),
        "straggler/slowest_ranks": [
            {"rank": r, "host": hosts[r], "rel": round(rel[r], 4)} for r in slowest
        ],
    }
