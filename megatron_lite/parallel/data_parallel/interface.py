"""The interface every data-parallel wrapper offers (ZeRO-0/1/2: `DataParallel`; ZeRO-3:
`FullyShardedDataParallel`), so the trainer, the checkpointer and the tools never ask which
stage runs.

One step, on every rank:

    dp.start_step(num_microbatches)     # before the first backward
    ...                                 # forward and backward of each microbatch, each
                                        # backward after dp.before_backward(chunk, is_last),
                                        # each W (split schedules) then dp.after_weight(...)
    dp.finish_grad_sync()               # every gradient reduced (and its TP/tied sums)
    sq = dp.grad_square_sum()           # this rank's share of Σg²; all-reduce over the world
    dp.clip(sq.item() ** 0.5, max_norm)
    dp.step()                           # the optimizer on this rank's shards, weights gathered
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megatron_lite.parallel.data_parallel.finalize import LocalGrad
from megatron_lite.parallel.data_parallel.optimizer_spec import OptimizerSpec
from megatron_lite.parallel.mesh import ParallelMesh


@dataclass
class StateShard:
    """Elements [lo, hi) of parameter `param`'s flattened (TP-local) tensor whose optimizer
    state this rank holds: `states` maps the spec's state names (`OptimizerSpec.state_names`;
    AdamW: "exp_avg", "exp_avg_sq"), and "master" for an fp32 copy kept apart from the
    parameter, to contiguous tensors of hi - lo elements; `step` is the step count (0-d).
    `replicas`: the process group whose ranks hold identical copies (ZeRO-0's
    data-parallel group, hybrid sharding's replica group), None when no other rank of this
    TP rank does. Stage 3 (FSDP2): [lo, hi) are this rank's rows of the DTensor parameter."""

    param: torch.nn.Parameter
    lo: int
    hi: int
    states: dict[str, torch.Tensor]
    step: torch.Tensor
    replicas: dist.ProcessGroup | None


@runtime_checkable
class DataParallelOptimizer(Protocol):
    """The wrapper's optimizer (`ShardedOptimizer`, `FSDPOptimizer`, `FSDPWholeMatrixOptimizer`)
    as the trainer and the checkpointer use it. Checkpoints hold logical per-parameter tensors
    whatever the stage; each rank writes them from, and loads them into, the shards it holds
    (`state_shards`)."""

    spec: OptimizerSpec  # what it is: its states, update and hyperparameters
    inner: torch.optim.Optimizer  # the torch optimizer stepping this rank's shards

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's groups (the trainer sets their `lr` every step)."""

    def step(self) -> None:
        """One optimizer step on this rank's shards (gradients finalized and clipped)."""

    def sync_masters_from_params(self) -> None:
        """After the parameters were loaded: fp32 masters kept apart from them follow."""

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weights compute in, which checkpoints store them in (stage 3: the
        sharded parameters are the fp32 masters, their compute copies this dtype)."""

    def state_shards(self) -> list[StateShard]:
        """The optimizer state this rank holds, one `StateShard` per (parameter, range): the
        optimizer's own tensors (no copy, no communication), so a checkpoint writes from them
        and a load reads into them."""


@runtime_checkable
class DataParallelWrapper(Protocol):
    """Gradient reduction and the optimizer for one rank's model chunks (see the module
    docstring for one step). Built by `build_data_parallel`."""

    mesh: ParallelMesh
    optimizer: DataParallelOptimizer

    def start_step(self, num_microbatches: int) -> None:
        """Before the step's first backward: gradients are final after this many microbatches
        (each chunk's backward runs once per microbatch)."""

    def before_backward(self, chunk: int, is_last: bool) -> None:
        """Before each backward of local chunk `chunk`, outside autograd (the pipeline engine
        calls it from its schedule table): `is_last` marks the step's last backward of that
        chunk. ZeRO-3 reduces only there; unannounced backwards each reduce (correct, more
        traffic). Stages 0-2 count their gradients themselves: nothing to do. Under a split
        (zero-bubble) schedule is_last is always False: the gradients are final after W."""

    def after_weight(self, chunk: int, is_last: bool) -> None:
        """After each W (the deferred weight-gradient GEMMs) of local chunk `chunk` under a
        split schedule, outside autograd: `is_last` marks the chunk's last W of the step,
        where ZeRO-3 reduces. Stages 0-2: nothing (the GEMMs report to their buckets)."""

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
