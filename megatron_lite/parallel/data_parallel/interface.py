"""The interface every data-parallel wrapper offers (ZeRO-0/1/2: `DataParallel`; ZeRO-3:
`FullyShardedDataParallel`), so the trainer, the checkpointer and the tools never ask which
stage runs.

One step, on every rank:

    dp.start_step(num_microbatches)     # before the first backward
    ...                                 # forward and backward of each microbatch
    dp.finish_grad_sync()               # every gradient reduced (and its TP/tied sums)
    sq = dp.grad_square_sum()           # this rank's share of Σg²; all-reduce over the world
    dp.clip(sq.item() ** 0.5, max_norm)
    dp.step()                           # AdamW on this rank's shards, weights gathered
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from megatron_lite.parallel.data_parallel.finalize import LocalGrad
from megatron_lite.parallel.mesh import ParallelMesh


@runtime_checkable
class DataParallelOptimizer(Protocol):
    """The wrapper's AdamW (`ShardedAdamW`, `FSDPAdamW`) as the trainer and the checkpointer
    use it. Checkpoints hold logical per-parameter tensors whatever the stage: the states are
    keyed by id(parameter) and hold this rank's whole TP/EP shard of each parameter."""

    inner: torch.optim.Optimizer  # the torch AdamW stepping this rank's shards

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's groups (the trainer sets their `lr` every step)."""

    def step(self) -> None:
        """One AdamW step on this rank's shards (gradients finalized and clipped)."""

    def sync_masters_from_params(self) -> None:
        """After the parameters were loaded: fp32 masters kept apart from them follow."""

    def full_states(self, with_master: bool) -> dict[int, dict[str, torch.Tensor]]:
        """id(param) -> {"exp_avg", "exp_avg_sq", "step"[, "master"]}, whole local tensors
        (collective over the shard group)."""

    def load_full_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """The inverse of `full_states`: each rank takes its shard."""

    def full_weights(self, gather: bool = True) -> dict[int, torch.Tensor]:
        """id(param) -> the whole local weight where the parameters are themselves sharded
        (ZeRO-3, collective); {} where they are whole (stages 0-2). gather=False: empty
        tensors of those shapes, for a load to fill."""

    def load_full_weights(self, weights: dict[int, torch.Tensor]) -> None:
        """The inverse of `full_weights` (nothing to do where the parameters are whole)."""


@runtime_checkable
class DataParallelWrapper(Protocol):
    """Gradient reduction and the optimizer for one rank's model chunks (see the module
    docstring for one step). Built by `build_data_parallel`."""

    mesh: ParallelMesh
    optimizer: DataParallelOptimizer

    def start_step(self, num_microbatches: int) -> None:
        """Before the step's first backward: gradients are final after this many microbatches
        (each chunk's backward runs once per microbatch)."""

    def finish_grad_sync(self) -> None:
        """After the step's last backward: every gradient reduced over its data-parallel group,
        SP replicas summed over TP and tied embeddings over the embedding group."""

    def local_grads(self) -> list[LocalGrad]:
        """After finish_grad_sync: the reduced gradients this rank holds (whole gradients, its
        ZeRO shard as pieces of parameters, or its FSDP2 shards), the only gradients to read
        (under ZeRO-2 a parameter's `main_grad` outside the step has no storage)."""

    def grad_square_sum(self) -> torch.Tensor:
        """This rank's share of the global Σg² (fp64 scalar); the sum over the world counts
        every element once (the caller all-reduces it, fused with whatever else it sends)."""

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale this rank's gradients by max_norm / norm when norm > max_norm > 0."""

    def step(self) -> None:
        """The optimizer step, then the updated weights made whole for the next forward."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's model-state tensors by term (what `memory` counts, for a tracker)."""

    def memory(self, device_type: str | None = None) -> dict[str, int]:
        """This rank's model-state bytes: {"weights", "grads", "master", "optimizer"}, unique
        storages, optionally only those on devices of `device_type`."""

    def wait_params(self) -> None:
        """Wait for weight all-gathers still in flight (before reading the weights)."""
