"""Bytes and calls per collective kind, per optimizer step, plus a short history of recent ops.

The recorder is the one process-wide object in the package (like torch's profiler): layers call
collectives through `mappings`, which report here, so per-step communication volume can be
logged without threading a stats object through every layer.

Two byte counts per kind: the payload (`comm_bytes/<kind>`: an all-gather counts its input
shard, a reduce-scatter its full input) and the bus bytes (`comm_bus_bytes/<kind>`: what each
rank sends on the wire under the ring algorithm, `bus_bytes`), the unit the planner uses.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

# op -> k in bus bytes = k·(n-1)/n·size: a ring all-reduce is a reduce-scatter + an all-gather
_RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 1}


def bus_bytes(op: str, size_bytes: int, n: int) -> float:
    """Bytes one rank sends under the ring algorithm (NCCL-tests' bus convention).

    `size_bytes` is the full (gathered / pre-scatter) tensor for all_gather and
    reduce_scatter, the tensor for all_reduce, the rank's whole input for all_to_all and the
    message for send and broadcast: (n-1)/n·size for all_gather, reduce_scatter and all_to_all,
    2(n-1)/n·size for all_reduce, size for send and broadcast (NCCL-tests' bus bandwidth of a
    broadcast is its algorithm bandwidth). An uneven all_to_all counts as if its input were
    split evenly.
    """
    if op in ("send", "broadcast"):
        return float(size_bytes)
    if op not in _RING_FACTOR:
        raise ValueError(f"bus_bytes: unknown op {op!r} (one of {[*_RING_FACTOR, 'send']})")
    if n < 1:
        raise ValueError(f"bus_bytes: group size must be >= 1, got {n}")
    return _RING_FACTOR[op] * (n - 1) / n * size_bytes


@dataclass
class CommStats:
    """Accumulates per-kind byte/call/element counts; `step` is the optimizer step being run."""

    step: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    bus_bytes: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    elements: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    # set by the straggler detector on CUDA (training/straggler.py): wraps each blocking
    # collective, so the time the compute stream stalls inside it is not counted as compute
    wait_timer: Callable[[], AbstractContextManager] | None = None

    def record(self, kind: str, tensor: torch.Tensor, group_name: str, *, op: str, n: int) -> None:
        """Count one collective `op` (see `bus_bytes`) of `kind` over a group of `n` ranks whose
        per-rank payload is `tensor` (all_gather: the input shard; others: the whole input)."""
        count = tensor.numel()
        payload = count * tensor.element_size()
        self.bytes[kind] += payload
        self.bus_bytes[kind] += bus_bytes(op, payload * n if op == "all_gather" else payload, n)
        self.calls[kind] += 1
        self.elements[kind] += count
        self.recent.append((self.step, kind, group_name, tuple(tensor.shape), str(tensor.dtype)))

    def note(self, kind: str, group_name: str) -> None:
        """Remember an op that moves no counted tensor (checkpoint control, object gathers)."""
        self.recent.append((self.step, kind, group_name, (), None))

    def start_step(self, step: int) -> None:
        self.step = step
        self.bytes.clear()
        self.bus_bytes.clear()
        self.calls.clear()
        self.elements.clear()

    def summary(self) -> dict[str, int | float]:
        """Flat dict for metrics.jsonl: comm_bytes/<kind>, comm_bus_bytes/<kind> and
        comm_calls/<kind>."""
        out: dict[str, int | float] = {f"comm_bytes/{k}": v for k, v in sorted(self.bytes.items())}
        out.update({f"comm_bus_bytes/{k}": v for k, v in sorted(self.bus_bytes.items())})
        out.update({f"comm_calls/{k}": v for k, v in sorted(self.calls.items())})
        return out


STATS = CommStats()
