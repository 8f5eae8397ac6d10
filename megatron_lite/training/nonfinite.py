"""The non-finite guard: a NaN/Inf loss or gradient norm stops the run, or skips the step.

The loss and the gradient norm are already reduced over the world, so every rank sees the same
two numbers and takes the same decision (no rank is left waiting in a collective). When the
gradient norm is not finite, each rank looks for the parameters whose local gradients hold
NaN/Inf (only then: it costs one pass over the gradients) and the names are gathered, so the
message says which parameter on which rank. Under `train.skip_nonfinite_steps: N` a
non-finite step is skipped (no optimizer update) and the run stops after N in a row, as
Megatron does for its loss-scaler skips.

Tensors the step changes outside the optimizer (the MoE router's expert bias, moved by the
token counts) get no gradient, so the two numbers above never see them. A module declares
such state with a method `step_updated_state()` returning (name, tensor, the config key that
drives the update); `StateGuard` finds every declaring module of the model and checks their
tensors after each step, so new state of that kind is covered without changing the guard. A
non-finite one always stops the run (a skip cannot undo an update the optimizer did not make),
before the step's checkpoint could store it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_lite.parallel import host, mappings
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


def step_updated_state(modules) -> list[tuple[str, torch.Tensor, str]]:
    """(name in its model chunk, tensor, config key) of every tensor that `modules` (the model
    chunks) declare through a `step_updated_state()` method: state the step updates outside
    the optimizer."""
    out = []
    for module in modules:
        for prefix, m in module.named_modules():
            declare = getattr(m, "step_updated_state", None)
            if callable(declare):
                for name, tensor, key in declare():
                    out.append((f"{prefix}.{name}" if prefix else name, tensor, key))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of `t` (a ZeRO-3 DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


class StateGuard:
    """Checks the state the model declares as step-updated (module docstring) after each step:
    NonFiniteError on every rank when any rank's holds NaN/Inf. Construct and `check` on every
    rank; one all-reduce at construction says whether any rank declares state, then one
    all-reduce of one number per step where some does (none otherwise)."""

    def __init__(self, modules, device: torch.device):
        self.modules, self.device = list(modules), device
        here = float(len(step_updated_state(self.modules)))
        count = torch.tensor([here], dtype=torch.float64, device=device)
        mappings.all_reduce(count, dist.group.WORLD, op=dist.ReduceOp.MAX, kind="all_reduce_state")
        self.active = host.read(count, [here])[0] > 0

    def check(self, step: int) -> None:
        """After the step's updates; `step` 1-based, as the progress line counts."""
        if not self.active:
            return
        state = step_updated_state(self.modules)
        bad = torch.zeros(1, dtype=torch.float64, device=self.device)
        for _, tensor, _ in state:
            bad += (~torch.isfinite(_local(tensor.detach()))).any().to(bad.dtype)
        mappings.all_reduce(bad, dist.group.WORLD, kind="all_reduce_state")
        if host.read(bad, [0.0])[0] == 0:
            return
        mine = [(n, k) for n, t, k in state if not bool(torch.isfinite(_local(t.detach())).all())]
        everyone = [None] * dist.get_world_size()
        guarded("all_gather_object", None, lambda: dist.all_gather_object(everyone, mine))
        found = [f"{n} on rank {r}" for r, names in enumerate(everyone) for n, _ in names]
        keys = sorted({k for names in everyone for _, k in names})
        raise NonFiniteError(
            f"step {step}: non-finite state updated outside the optimizer in "
            f"{'; '.join(found[:6])} (driven by {', '.join(keys)}). Training stopped (a "
            f"skipped step cannot undo it, so train.skip_nonfinite_steps does not apply). Fix: "
            f"lower {', '.join(keys)}, or resume from an earlier checkpoint."
        )
