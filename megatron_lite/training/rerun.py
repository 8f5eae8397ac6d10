"""Rerunning a suspicious step (train.rerun_on): a transient hardware fault, or the data/model?

Before each step's forward the step keeps what a replay needs: the RNG states (torch's CPU
generator, the CUDA one, and the model-parallel tracker's, parallel/random.py). The batch is
the step's own list of microbatches (not changed by the step) and the gradient buffers are
zeroed when a step starts, so a replay is: restore the RNG states, start the step again, and
redo the forward and backward, the gradient reduction and the world all-reduce of the norm
and the loss. All of this happens before the optimizer steps, so the weights are untouched.

Triggers, on the world-reduced loss and gradient norm (every rank holds the same two float64
numbers, so every rank takes the same decision without a collective of its own, as the
non-finite guard does):
- `nonfinite`: the loss or the gradient norm is NaN/Inf;
- `spike`: the loss, or the gradient norm, exceeds train.spike_factor × its reference: the
  mean of the last SPIKE_WINDOW taken steps' values (finite ones; none before MIN_HISTORY
  steps were taken). The gradient norm is watched too because a gradient fault does not move
  the step's loss (computed before the backward): a flipped high exponent bit of one fp32
  gradient element multiplies it by 2^128, and the fp64 norm (finalize.grad_square_sum)
  shows a finite norm ~1e30 or more: a grad-norm spike, not a non-finite norm.

On a trigger the step is replayed once. The replay reproduces it when it trips the same
trigger again:
- reproduced non-finite: the data or the model; the existing policy acts on the replay's
  numbers (nonfinite.py: stop with the named error, or skip under
  train.skip_nonfinite_steps);
- reproduced spike: the data or the model; the step is taken as computed, logged on rank 0
  and counted (rerun/reproduced_spikes); its values enter the reference, so a lasting change
  of level stops triggering after a few steps;
- not reproduced: a suspected hardware fault. Every rank compares its own share of the
  reduced numbers (its Σg² share and loss part) between the two runs, bitwise; one gather
  (only on this path) names the ranks whose share changed, with their hosts. The run goes on
  with the replay's result and counts it (rerun/transient_faults). A fault before the
  gradient reduction shows in the share of every rank of the group that reduced it.

A replay is bitwise the first run on deterministic kernels (CPU; on CUDA, kernels with
atomics may differ in the last bits: a replay still trips a real trigger again). State a
forward changes besides the gradients is restored or dropped by the caller (`before_replay`:
the MoE routing statistics); FP8 delayed scaling's amax history is not restored.
"""

from __future__ import annotations

import math
import socket
import struct
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.checkpoint.state import rng_states, set_rng_states
from megatron_lite.parallel import mappings
from megatron_lite.parallel.random import RNGStatesTracker

SPIKE_WINDOW = 10  # taken steps in the spike reference (their mean)
MIN_HISTORY = 3  # taken steps before a spike can trigger


@dataclass
class Attempt:
    """One forward/backward of a step, reduced: loss and gradient norm (world), this rank's
    shares of them (0-d tensors), and the flags' world sums."""

    loss: float
    grad_norm: float
    local: tuple[torch.Tensor, torch.Tensor]  # this rank's (Σg² share, loss part)
    flags: list[float]


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


_NO_TRACKER = types.SimpleNamespace(states={})  # a run without one: torch's generators alone


class StepRerun:
    """The trigger, the replay and its verdict (module docstring); mode: train.rerun_on;
    tracker: the run's RNGStatesTracker (None: only torch's generators)."""

    def __init__(
        self,
        mode: str,
        spike_factor: float,
        device: torch.device,
        tracker: RNGStatesTracker | None = None,
    ):
        self.nonfinite = mode in ("nonfinite", "both")
        self.spike = mode in ("spike", "both")
        self.active = self.nonfinite or self.spike
        self.spike_factor, self.device, self.tracker = spike_factor, device, tracker
        self.losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.norms: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.counts = {"replays": 0, "transient_faults": 0, "reproduced_spikes": 0}
        self.counts["reproduced_nonfinite"] = 0
        self.messages: list[str] = []  # what rank 0 printed (every rank keeps them)

    def capture(self) -> dict[str, torch.Tensor]:
        """The RNG states a replay restores (before the step's forward): a checkpoint's own
        (checkpoint/state.py rng_states)."""
        return rng_states(self.tracker or _NO_TRACKER)

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        set_rng_states(self.tracker or _NO_TRACKER, saved)

    def trigger(self, loss: float, grad_norm: float) -> str | None:
        """What is suspicious about these world-reduced numbers (None: nothing)."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "non-finite" if self.nonfinite else None
        if not self.spike or len(self.losses) < MIN_HISTORY:
            return None
        watched = (("loss", loss, self.losses), ("grad norm", grad_norm, self.norms))
        for name, value, seen in watched:
            ref = sum(seen) / len(seen)
            if value > self.spike_factor * ref:
                return f"{name} spike ({name} {value:.4g} > {self.spike_factor:g} × {ref:.4g})"
        return None

    def check(self, step: int, first: Attempt, replay: Callable[[], Attempt]) -> Attempt:
        """Step `step` (1-based) ran as `first`: on a trigger replay it once (`replay()`, which
        restores the RNG states) and decide (module docstring) -> the attempt to continue with."""
        why = self.trigger(first.loss, first.grad_norm)
        if why is None:
            self._taken(first)
            return first
        self.counts["replays"] += 1
        again = replay()
        why_again = self.trigger(again.loss, again.grad_norm)
        same = _bits(first.loss) == _bits(again.loss)
        same = same and _bits(first.grad_norm) == _bits(again.grad_norm)
        if why_again is not None:
            verdict = "bitwise" if same else f"not bitwise: {why_again}"
            if why_again == "non-finite":  # the guard acts on the replay's numbers
                self.counts["reproduced_nonfinite"] += 1
                action = "the non-finite policy acts (train.skip_nonfinite_steps)"
            else:
                self.counts["reproduced_spikes"] += 1
                action = "step taken as computed"
            self._say(
                f"step {step}: {why} reproduced on replay ({verdict}): the data or the "
                f"model, not a transient fault; {action}"
            )
        else:
            self.counts["transient_faults"] += 1
            where = self._suspects(first, again)
            self._say(
                f"step {step}: {why} did not reproduce on replay (loss {again.loss:.6g}, grad "
                f"norm {again.grad_norm:.6g}): suspected hardware fault on {where}; "
                "continuing with the replay's result"
            )
        self._taken(again)
        return again

    def _taken(self, attempt: Attempt) -> None:
        if math.isfinite(attempt.loss) and math.isfinite(attempt.grad_norm):
            self.losses.append(attempt.loss)
            self.norms.append(attempt.grad_norm)

    def _suspects(self, first: Attempt, again: Attempt) -> str:
        """The ranks (with hosts) whose own shares changed between the runs (a gather)."""
        pairs = zip(first.local, again.local, strict=True)
        changed = any(_bits(float(a)) != _bits(float(b)) for a, b in pairs)
        everyone = [None] * dist.get_world_size()
        mine = (changed, socket.gethostname())
        mappings.guarded(
            "all_gather_object", None,
            lambda: mappings.all_gather_objects(everyone, mine, dist.group.WORLD),
        )  # fmt: skip
        named = [f"rank {r} ({h})" for r, (c, h) in enumerate(everyone) if c]
        return ", ".join(named[:8]) or "no single rank (no rank's own share changed)"

    def _say(self, text: str) -> None:
        self.messages.append(text)
        if dist.get_rank() == 0:
            print(f"[rerun] {text}", flush=True)

    def metrics(self) -> dict:
        """rerun/* counts since the run started (this process), for the step's record."""
        return {f"rerun/{k}": v for k, v in self.counts.items()} if self.active else {}
