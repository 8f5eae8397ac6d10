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
`is_recomputing()` is true while a recompute runs, for code with side effects (MoE statistics).
The inputs the checkpoint keeps are saved for backward through an identity autograd Function
(`_KeepInput`), so saved-tensor hooks (the activation meter) see the bytes it holds.
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


def is_recomputing() -> bool:
    """Whether the caller runs inside a backward-time recompute of `recompute`."""
    return _RECOMPUTING.get()


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


def recompute(fn: Callable, *args, tracker: RNGStatesTracker) -> torch.Tensor:
    """fn(*args), saving only `args` for backward; fn runs again in backward (module doc)."""
    args = tuple(
        _KeepInput.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args
    )
    at_call: dict[str, tuple] = {}

    @contextlib.contextmanager
    def forward_context():
        at_call.update(tracker.states)  # states are replaced on use, never mutated in place
        yield

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
