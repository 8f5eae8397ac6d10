"""Host synchronizations of a dry-run step (`plan --dry-run --device cuda`), by phase and line.

On a GPU the host queues kernels and runs ahead; a value read back to Python (`.item()`,
`.tolist()`, `.cpu()`, a shape that depends on data: `nonzero`, a boolean mask, `unique`;
`torch.equal`; printing a device tensor) or an explicit wait (`torch.cuda.synchronize`, an
event's `synchronize`) stops it until the GPU catches up. The step's reads go through
`parallel.host.read` (the dry run's seam), which reads nothing under fake tensors, so the
count here comes from three places: host.read calls (counted by patching the seam inside
the dry run), the aten ops that need a value or a data-dependent size (SYNC_OPS, seen by
plan/device_check.py's dispatch mode), and the stand-in runtime's waits (plan/fake_cuda.py).

Each sync is recorded with the step it happened in, its phase and the source line that asked
for it (the first frame in megatron_lite outside the dry run's own machinery). Phases are the
Trainer's, as its MemoryTracker names them (training/step.py `TrainStep.run`): "forward" and
"backward" (the microbatch loop: forward, backward, recompute, the weight-gradient pass),
"grad sync", "optimizer"; outside them, "before forward" (the step's set-up: the global token
count), "norm/loss" (between the gradient sync and the optimizer: the reduced norm, loss
and flags that clipping and the non-finite guard need), "logging" (after the optimizer:
metrics, state checks, the step's timing). docs/cuda_dry_run.md states the bound the
steady microbatch loop keeps.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

aten = torch.ops.aten
# aten op -> the kind of host sync it is on a GPU
SYNC_OPS = {
    aten._local_scalar_dense: ".item()/.tolist()",
    aten.is_nonzero: "bool(tensor)",
    aten.nonzero: "nonzero",
    aten.masked_select: "boolean mask",
    aten.unique_consecutive: "unique",
    aten._unique2: "unique",
    aten.unique_dim: "unique",
    aten.equal: "torch.equal",
}
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(PACKAGE)
# the dry run's own machinery: a sync or a tensor is charged to the code that called into it
MACHINERY = {
    os.path.join(PACKAGE, *p)
    for p in (
        ("plan", "host_sync.py"),
        ("plan", "device_check.py"),
        ("plan", "fake_cuda.py"),
        ("parallel", "host.py"),
        ("parallel", "fake.py"),
        ("training", "memory_tracker.py"),
    )
}
# torch, the standard library and site-packages: not where a tensor or a sync is charged
LIBRARIES = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.__file__))
# the dispatch modes around the step (caller_file(machinery=True) skips only these)
CHECKERS = {
    os.path.join(PACKAGE, *p)
    for p in (("plan", "host_sync.py"), ("plan", "device_check.py"),
              ("training", "memory_tracker.py"))
}  # fmt: skip
STEP_PHASES = ("forward", "backward", "grad sync", "optimizer")
# after the step phase (key), outside any phase: what the step is doing
BETWEEN = {None: "before forward", "forward": "before grad sync", "grad sync": "norm/loss",
           "optimizer": "logging"}  # fmt: skip


def source_line(skip: int = 1) -> str:
    """The caller's position as "megatron_lite/x.py:123 in fn": the innermost frame outside
    torch, the standard library and site-packages, and MACHINERY (the package's code, or a
    test's), relative to the repository root ("<torch>" if none: torch's own code)."""
    f = sys._getframe(skip)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if not name.startswith(LIBRARIES) and name not in MACHINERY and not name.startswith("<"):
            rel = os.path.relpath(name, ROOT).replace(os.sep, "/")
            return f"{rel}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "<torch>"


TORCH = os.path.dirname(os.path.abspath(torch.__file__))
PLUMBING = {
    os.path.join(TORCH, *p)
    for p in (("_ops.py",), ("utils", "_python_dispatch.py"), ("_compile.py",),
              ("_dynamo", "eval_frame.py"))
}  # fmt: skip


def caller_file(machinery: bool = False) -> str:
    """The file of the innermost frame outside torch's dispatch plumbing and MACHINERY (with
    `machinery`: outside the dispatch modes only, so the stand-ins count): the Python code
    whose call reached the current op (a torch file when torch's own Python, or its C++
    through autograd's engine, made it)."""
    f = sys._getframe(1)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if name not in PLUMBING and name not in (CHECKERS if machinery else MACHINERY):
            return name
        f = f.f_back
    return ""


def step_phase(where: str) -> str | None:
    """The Trainer's phase of a MemoryTracker position (`MemoryTracker.where()`), or None
    outside the step's phases."""
    if where.startswith("forward"):
        return "forward"
    if where == "backward" or where.startswith(("recompute", "backward", "weight")):
        return "backward"
    return where if where in STEP_PHASES else None


@dataclass
class Sync:
    step: int
    phase: str
    kind: str
    where: str


@dataclass
class HostSyncs:
    """The syncs of a dry run, recorded as they happen (`record`); `tracker` (a
    MemoryTracker) gives the phase, `step` the step number (-1 outside train_step)."""

    tracker: object = None
    step: int = -1
    last_phase: str | None = None  # the last step phase entered in this step
    syncs: list[Sync] = field(default_factory=list)

    def phase(self) -> str:
        where = self.tracker.where() if self.tracker is not None else "build"
        now = step_phase(where)
        if now is not None:
            return now
        return "build" if self.step < 0 else BETWEEN[self.last_phase]

    def record(self, kind: str, skip: int = 2) -> None:
        self.syncs.append(Sync(self.step, self.phase(), kind, source_line(skip + 1)))

    @contextlib.contextmanager
    def in_step(self, step: int) -> Iterator[None]:
        """Syncs inside the block belong to step `step` (0-based)."""
        self.step, self.last_phase = step, None
        try:
            yield
        finally:
            self.step, self.last_phase = -1, None

    def note_phase(self, name: str) -> None:
        """A step phase was left (MemoryTracker.phase's exit): what follows is after it."""
        now = step_phase(name)
        if now in BETWEEN:
            self.last_phase = now

    def counts(self, step: int) -> Counter:
        """{(phase, kind, where): count} of `step`."""
        return Counter((s.phase, s.kind, s.where) for s in self.syncs if s.step == step)


@contextlib.contextmanager
def counting_reads(syncs: HostSyncs) -> Iterator[None]:
    """Inside the block every `parallel.host.read` and every repr of a CUDA tensor (what
    print and f-strings call) is recorded in `syncs` as a host sync."""
    from megatron_lite.parallel import host
    from megatron_lite.plan.fake_cuda import _patched

    read, repr_ = host.read, torch.Tensor.__repr__

    def counted_read(t, nominal):
        syncs.record("host.read")
        return read(t, nominal)

    def counted_repr(t, *a, **kw):
        if t.device.type == "cuda":
            syncs.record("print")
        return repr_(t, *a, **kw)

    with _patched(host, {"read": counted_read}), _patched(torch.Tensor, {"__repr__": counted_repr}):
        yield


def sync_table(counts: Counter, microbatches: int) -> str:
    """The step's syncs as lines "phase: n" then "  count × kind at file:line"."""
    if not counts:
        return "  host syncs in the step: none"
    by_phase: dict[str, list] = {}
    for (phase, kind, where), n in sorted(counts.items()):
        by_phase.setdefault(phase, []).append((n, kind, where))
    total = sum(counts.values())
    lines = [f"  host syncs in the steady step ({microbatches} microbatches): {total}"]
    order = ["before forward", "forward", "backward", "before grad sync", "grad sync",
             "norm/loss", "optimizer", "logging"]  # fmt: skip
    for phase in sorted(by_phase, key=lambda p: order.index(p) if p in order else len(order)):
        rows = by_phase[phase]
        lines.append(f"    {phase}: {sum(n for n, _, _ in rows)}")
        lines += [f"      {n} × {kind} at {where}" for n, kind, where in rows]
    return "\n".join(lines)
