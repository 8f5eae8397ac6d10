"""RNG states for dropout under model parallelism.

The default generator is seeded identically on every TP rank of a pipeline stage (dropout on
replicated activations must match across TP). Inside the tensor-parallel region (attention
dropout over this rank's heads) and on sequence-parallel shards, masks must differ per TP rank:
code there runs under `tracker.fork()`, which swaps in a generator seeded per TP rank.
Dropout masks therefore depend on the layout; loss-parity runs use dropout 0.
"""

from __future__ import annotations

import contextlib

import torch

TP_RNG = "tensor-parallel-rng"


class RNGStatesTracker:
    """Named RNG states that `fork(name)` swaps in (CPU, and CUDA when available)."""

    def __init__(self):
        self.states: dict[str, tuple] = {}

    @staticmethod
    def _get():
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return torch.get_rng_state(), cuda

    @staticmethod
    def _set(state):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    def add(self, name: str, seed: int) -> None:
        saved = self._get()
        torch.manual_seed(seed)
        self.states[name] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG):
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)


def dropout(
    x: torch.Tensor, p: float, tracker: RNGStatesTracker | None = None, per_tp_rank: bool = False
) -> torch.Tensor:
    """Dropout while gradients are enabled (training); activations that differ per TP rank
    (sequence-parallel shards) draw their mask from the tracker's TP-rank state."""
    if p == 0.0 or not torch.is_grad_enabled():
        return x
    with tracker.fork() if per_tp_rank else contextlib.nullcontext():
        return torch.nn.functional.dropout(x, p, training=True)


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int) -> RNGStatesTracker:
    """Seed the default generator per pipeline stage and a TP-rank-specific tracker state."""
    torch.manual_seed(seed + 100 * pp_rank)
    tracker = RNGStatesTracker()
    tracker.add(TP_RNG, seed + 2718 + 100 * pp_rank + tp_rank)
    return tracker
