"""torch.profiler traces of chosen steps (train.profile_steps), per rank.

Steps a..b (the metrics' 0-based step numbers) run under `torch.profiler.profile` with
profile_memory=True (allocations and frees: the memory timeline), CUDA activity on GPUs, and
one `step <n>` range per step; the trace is written as Chrome/Perfetto JSON to
`<out_dir>/profile/rank<r>/trace_steps<a>-<b>.json`. On CUDA, train.profile_memory_snapshot also
records the allocator's history over those steps and dumps `memory_snapshot.pickle` beside it
(open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import os

import torch


def _cuda_memory_history(enabled: bool, dump_to: str | None = None) -> None:
    """Start (True) or dump to `dump_to` and stop (False) recording the CUDA allocator's
    history: the private torch calls of this module (torch.cuda.memory._record_memory_history,
    _dump_snapshot)."""
    if not enabled and dump_to is not None:
        torch.cuda.memory._dump_snapshot(dump_to)
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=1_000_000)


class StepProfiler:
    """Profiles steps [a, b] of a run; `steps` empty: does nothing."""

    def __init__(
        self,
        steps: list[int],
        out_dir: str,
        rank: int,
        device: torch.device,
        memory_snapshot: bool = False,
    ):
        self.first, self.last = (steps[0], steps[1]) if steps else (-1, -1)
        self.dir = os.path.join(out_dir, "profile", f"rank{rank}")
        self.cuda, self.snapshot = device.type == "cuda", memory_snapshot and device.type == "cuda"
        self.prof: torch.profiler.profile | None = None
        self.range: contextlib.AbstractContextManager | None = None
        self.done = False  # the range was profiled (a resumed run may start inside it)

    def before_step(self, step: int) -> None:
        if self.prof is None and self.first <= step <= self.last and not self.done:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.snapshot:
                _cuda_memory_history(True)
            self.prof = torch.profiler.profile(
                activities=activities, profile_memory=True, record_shapes=True
            )
            self.prof.__enter__()
        if self.prof is not None:
            self.range = torch.profiler.record_function(f"step {step}")
            self.range.__enter__()

    def after_step(self, step: int) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if step == self.last:
            self.close()

    def close(self) -> str | None:
        """Stop and write the trace (also when the run stopped inside the range); its path."""
        if self.prof is None:
            return None
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        self.prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"trace_steps{self.first}-{self.last}.json")  # the range
        self.prof.export_chrome_trace(path)
        self.prof, self.done = None, True
        if self.snapshot:
            _cuda_memory_history(False, os.path.join(self.dir, "memory_snapshot.pickle"))
        return path
