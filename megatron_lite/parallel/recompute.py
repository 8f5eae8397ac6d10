"""Activation recomputation: run a function keeping only its inputs, and run it again in backward
to rebuild what its backward needs (Megatron's `CheckpointFunction`).

Built on torch.utils.checkpoint in its non-reentrant mode (the one FSDP2 composes with: the
forward runs with gradients enabled and the autograd graph is the original one; the recompute
only refills its saved tensors). The recompute repeats the forward bit for bit:
- torch restores the default CPU (and CUDA) generator state of the call;
- the `RNGStatesTracker`'s named states (the per-TP-rank dropout generator that attention
  dropout and sequence-parallel shards fork into) are set back to their values at the call for
  the recompute and put back afterwards, so the tracker's stream runs on as if nothing had been
  recomputed;
- the whole function runs again (no early stop), so every collective inside it runs again on
  every rank in the same order.
`is_recomputing()` is true while a recompute runs, for code with side effects (MoE statistics);
`in_region()` while the forward of a checkpointed region runs (nothing is saved for backward
there: the activation offloader steps aside).
The inputs the checkpoint keeps are saved for backward through an identity autograd Function
(`_KeepInput`), so saved-tensor hooks (the activation meter) see the bytes it holds.

`regions_run_by(runner)`: inside it, `recompute(fn, *args)` returns `runner(fn, args)` instead
(no checkpoint). The planner (plan/saved.py) runs each recomputable region as a plain call
that way, marking what is saved inside it and what it would keep, so one forward gives the
saved bytes of every `recompute_modules` choice.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megatron_lite.parallel.random import RNGStatesTracker

# a flag of the running thread's context, like torch's grad mode (not shared between threads)
_RECOMPUTING = contextvars.ContextVar("megatron_lite_recomputing", default=False)
# a checkpointed region's forward is running (in_region)
_IN_REGION = contextvars.ContextVar("megatron_lite_in_region", default=False)
# regions_run_by's runner, or None (the checkpoint)
_RUNNER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "megatron_lite_region_runner", default=None
)


def is_recomputing() -> bool:
    """Whether the caller runs inside a backward-time recompute of `recompute`."""
    return _RECOMPUTING.get()


def in_region() -> bool:
    """Whether the caller runs inside the forward of a `recompute` region."""
    return _IN_REGION.get()


class _KeepInput(torch.autograd.Function):
    """Identity whose backward holds its input: what a non-reentrant checkpoint keeps alive
    anyway, made visible to saved-tensor hooks (its own hooks hide everything inside)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


@contextlib.contextmanager
def regions_run_by(runner: Callable):
    """`recompute(fn, *args)` is `runner(fn, args)` inside the block (module docstring)."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def keeps(a) -> bool:
    """Whether `recompute` keeps argument `a` for backward (through `_KeepInput`)."""
    return isinstance(a, torch.Tensor) and a.requires_grad


def recompute(fn: Callable, *args, tracker: RNGStatesTracker) -> torch.Tensor:
    """fn(*args), saving only `args` for backward; fn runs again in backward (module doc)."""
    runner = _RUNNER.get()
    if runner is not None:
        return runner(fn, args)
    args = tuple(_KeepInput.apply(a) if keeps(a) else a for a in args)
    at_call: dict[str, tuple] = {}

    @contextlib.contextmanager
    def forward_context():
        at_call.update(tracker.states)  # states are replaced on use, never mutated in place
        token = _IN_REGION.set(True)
        try:
            yield
        finally:
            _IN_REGION.reset(token)

    @contextlib.contextmanager
    def recompute_context():
        now = dict(tracker.states)
        tracker.states.update(at_call)
        token = _RECOMPUTING.set(True)
        try:
            yield
        finally:
            _RECOMPUTING.reset(token)
            tracker.states.clear()
            tracker.states.update(now)

    with set_checkpoint_early_stop(False):
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=lambda: (forward_context(), recompute_context()),
        )
