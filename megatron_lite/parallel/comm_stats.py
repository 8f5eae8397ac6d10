"""Bytes and calls per collective kind, per optimizer step, plus a short history of recent ops.

The recorder is the one process-wide object in the package (like torch's profiler): layers call
collectives through `mappings`, which report here, so per-step communication volume can be
logged without threading a stats object through every layer.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch


@dataclass
class CommStats:
    """Accumulates per-kind byte/call/element counts; `step` is the optimizer step being run."""

    step: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    elements: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))

    def record(self, kind: str, tensor: torch.Tensor, group_name: str) -> None:
        """Count one collective of `kind` whose per-rank payload is `tensor`."""
        n = tensor.numel()
        self.bytes[kind] += n * tensor.element_size()
        self.calls[kind] += 1
        self.elements[kind] += n
        self.recent.append((self.step, kind, group_name, tuple(tensor.shape), str(tensor.dtype)))

    def note(self, kind: str, group_name: str) -> None:
        """Remember an op that moves no counted tensor (checkpoint control, object gathers)."""
        self.recent.append((self.step, kind, group_name, (), None))

    def start_step(self, step: int) -> None:
        self.step = step
        self.bytes.clear()
        self.calls.clear()
        self.elements.clear()

    def summary(self) -> dict[str, int]:
        """Flat dict for metrics.jsonl: comm_bytes/<kind> and comm_calls/<kind>."""
        out = {f"comm_bytes/{k}": v for k, v in sorted(self.bytes.items())}
        out.update({f"comm_calls/{k}": v for k, v in sorted(self.calls.items())})
        return out


STATS = CommStats()
