"""The non-finite guard: a NaN/Inf loss or gradient norm stops the run, or skips the step.

The loss and the gradient norm are already reduced over the world, so every rank sees the same
two numbers and takes the same decision (no rank is left waiting in a collective). When the
gradient norm is not finite, each rank looks for the parameters whose local gradients hold
NaN/Inf (only then: it costs one pass over the gradients) and the names are gathered, so the
message says which parameter on which rank. Under `train.skip_nonfinite_steps: N` a
non-finite step is skipped (no optimizer update) and the run stops after N in a row, as
Megatron does for its loss-scaler skips.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_lite.parallel.mappings import guarded


class NonFiniteError(RuntimeError):
    """Training produced a NaN/Inf loss or gradient; the message is meant for the user."""


def nonfinite_grads(named_grads: Iterable[tuple[str, torch.Tensor]], limit: int = 3):
    """Names of (up to `limit`) parameters whose reduced gradient (this rank's whole gradient,
    shard or piece of one, see DataParallelWrapper.local_grads) holds NaN or Inf."""
    bad = []
    for name, grad in named_grads:
        if name not in bad and not bool(torch.isfinite(grad).all()):
            bad.append(name)
            if len(bad) == limit:
                break
    return bad


NamedGrads = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def describe(
    step: int, loss: float, grad_norm: float, local_loss: float, named_grads: NamedGrads
) -> str:
    """What went non-finite at `step` (1-based, as the progress line), gathered over the
    world (call on every rank).
    `local_loss` is this rank's share of the loss sum (0 on ranks that report none), a number
    or a 0-dim tensor, and `named_grads()` lists (parameter name, reduced local gradient); both
    are read only here, off the finite path."""
    grads = nonfinite_grads(named_grads()) if not math.isfinite(grad_norm) else []
    mine = (not math.isfinite(float(local_loss)), grads)
    everyone = [None] * dist.get_world_size()
    guarded("all_gather_object", None, lambda: dist.all_gather_object(everyone, mine))
    parts = []
    if not math.isfinite(loss):
        ranks = [r for r, (bad_loss, _) in enumerate(everyone) if bad_loss]
        parts.append(f"the loss is {loss} (on rank{'s' * (len(ranks) > 1)} {_list(ranks)})")
    if not math.isfinite(grad_norm):
        found = [f"{name} on rank {r}" for r, (_, names) in enumerate(everyone) for name in names]
        where = "; ".join(found[:6]) or "no single parameter (the sum of squares overflowed)"
        parts.append(f"the gradient norm is {grad_norm}: non-finite gradient in {where}")
    return f"step {step}: " + ", and ".join(parts)


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")


class NonFiniteGuard:
    """Counts consecutive non-finite steps. `check` returns None for a finite step, a warning
    for a step to skip, and raises NonFiniteError when the run must stop."""

    def __init__(self, skip_limit: int):
        self.skip_limit, self.in_a_row = skip_limit, 0

    def check(self, step, loss, grad_norm, local_loss, named_grads: NamedGrads) -> str | None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return None
        what = describe(step, loss, grad_norm, local_loss, named_grads)
        self.in_a_row += 1
        if self.in_a_row <= self.skip_limit:
            return (
                f"warning: {what}; step skipped (no update), {self.in_a_row} of at most "
                f"train.skip_nonfinite_steps={self.skip_limit} in a row"
            )
        fix = (
            "lower train.lr, check the data and the model settings (norm_eps, rope_theta, "
            "init_method_std), or resume from an earlier checkpoint"
        )
        if self.skip_limit:
            what += f" ({self.in_a_row} non-finite steps in a row, more than "
            what += f"train.skip_nonfinite_steps={self.skip_limit})"
        else:
            fix += "; train.skip_nonfinite_steps=N skips up to N such steps in a row"
        raise NonFiniteError(f"{what}. Training stopped. Fix: {fix}.")
