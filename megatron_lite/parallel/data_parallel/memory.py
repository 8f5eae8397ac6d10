"""Model-state memory, measured by walking the tensors actually allocated (unique storages),
and the formula it is checked against (docs/data_parallel.md, "Model-state memory").

Bytes per parameter held by this rank (its TP/PP/EP shard), with N the sharding degree and K the
optimizer's state bytes per parameter (`OptimizerSpec.state_bytes`: the sum of its states'
dtype sizes; AdamW's m and v in fp32: K = 8, the totals below):

| precision, stage | weights | grads | master | optimizer    | total    |
|------------------|---------|-------|--------|--------------|----------|
| fp32, 0          | 4       | 4     | 0      | K            | 16       |
| fp32, 1          | 4       | 4     | 0      | K/N          | 8 + 8/N  |
| fp32, 2          | 4       | 4/N   | 0      | K/N          | 4 + 12/N |
| bf16, 0          | 2       | 4     | 4      | K            | 18       |
| bf16, 1          | 2       | 4     | 4/N    | K/N          | 6 + 12/N |
| bf16, 2          | 2       | 4/N   | 4/N    | K/N          | 2 + 16/N |
| either, 3        | 4/N     | 4/N   | 0      | K/N          | 16/N     |

An optimizer whose update needs whole matrices keeps the whole gradients under ZeRO-2 too
(grads 4, as stage 1: whole_matrix.py), and its masters and states are those of the
parameters assigned to this rank, about 1/N of them (the formula's figure); under ZeRO-3 the
owner also keeps an fp32 whole copy of its parameters (master 4/N, fsdp_whole_matrix.py) and
holds their whole fp32 gradients during the step (grads: 4/N more). When only some groups
need whole matrices (train.optimizer=muon: Muon's matrices whole, AdamW's the rest flat), each
part follows its own rule, with the owner's share as it is, not 1/N: `split_formula_bytes`.

fp32 masters are the parameters themselves (0 extra) unless the optimizer is offloaded (then
4/N on the host). NVMe offload keeps masters and states in a swap file (nvme.py): in memory only
its host buffer (counted as optimizer), whatever the model's size.
Buckets are padded to a multiple of N, so a measurement can exceed the formula
by at most N - 1 elements per bucket.

Gradients that exist only during the step are part of the grads term, since the step's peak
holds them:
- ZeRO-2: the full-size fp32 buckets alive at once (buffers.py reduce-scatters every microbatch,
  one bucket per reduction group in flight while the next one accumulates): at most two
  buckets per group (dense, experts), 4 bytes per element. `buffer_state_bytes`: the two
  largest buckets of each group (`buffers.in_flight_bound`); the formula (`zero2_in_flight`):
  two buckets of fewer than bucket_size + the largest parameter's elements, at most the group's
  parameters. So grads = 4Ψ/N + 4·min(Ψ, 2·(bucket_size + largest − 1)) per group.
- ZeRO-3 with M > 1 microbatches: FSDP2 reduce-scatters once per step, in the last
  microbatch's backward (fsdp.py: `set_requires_gradient_sync` off before), so it keeps every
  unsharded gradient from the first microbatch's backward on, in the reduce dtype (r bytes:
  4 fp32, 2 bf16): grads = 4Ψ/N + r·Ψ. With M = 1, or under parallel.zero3_grad_reduce=microbatch
  (a reduce-scatter in every backward, the fp32 shards accumulating), only the unit being
  reduced holds them (the planner's walk, plan/peak.py): grads = 4Ψ/N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from megatron_lite.parallel.data_parallel.buffers import GradBuffer, in_flight_bound
from megatron_lite.parallel.data_parallel.fsdp_fp8 import Fp8GatherWeight
from megatron_lite.parallel.data_parallel.optimizer import Piece
from megatron_lite.parallel.data_parallel.optimizer_spec import ADAMW, OptimizerSpec

TERMS = ("weights", "grads", "master", "optimizer")


def storage_bytes(tensors, seen: set[int], device_type: str | None = None) -> int:
    """Bytes of the storages of `tensors` not in `seen` (storage identities, updated), each
    counted once, optionally only those on devices of `device_type`."""
    total = 0
    for t in tensors:
        if device_type is not None and t.device.type != device_type:
            continue  # e.g. the offloaded masters and moments when counting the GPU's bytes
        storage = t.untyped_storage()
        key = storage._cdata  # the storage's identity (also a fake tensor's: no data_ptr)
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t  # a DTensor counts its shard
    return t._tensor if isinstance(t, Fp8GatherWeight) else t  # its storage: the fp32 shard


def _optimizer_states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    states = [_local(t) for s in optimizer.state.values() for t in s.values()]
    return [t for t in states if isinstance(t, torch.Tensor) and t.dim() > 0]


def sharded_state_tensors(params, optimizer, masters=()) -> dict[str, list[torch.Tensor]]:
    """{term: tensors} of ZeRO-3 (FSDP2) model states on this rank: the local shards of the
    parameters (fp32: also the master weights), their gradients, the optimizer's states and
    `masters` (a whole-matrix optimizer's whole copies, fsdp_whole_matrix.py)."""
    return {
        "weights": [_local(p) for p in params],
        "grads": [_local(p.grad) for p in params if p.grad is not None],
        "master": list(masters),
        "optimizer": _optimizer_states(optimizer),
    }


def buffer_state_tensors(
    buffers: list[GradBuffer], pieces: list[Piece], optimizer: torch.optim.Optimizer, swap=None
) -> dict[str, list[torch.Tensor]]:
    """{term: tensors} of ZeRO-0/1/2 model states on this rank: the parameter and gradient
    buffers (and ZeRO-2 shards and the buckets' own storage, empty outside a backward), the
    pieces' fp32 masters, the AdamW states; under NVMe offload (`swap`, nvme.NvmeStates) the
    masters and states are empty and the host buffer they are read into counts as optimizer."""
    grads = [t for b in buffers for t in (b.grad_data, b.grad_shard) if t is not None]
    host = [] if swap is None else [swap.buffer]
    return {
        "weights": [b.param_data for b in buffers],
        "grads": grads + _bucket_grads(buffers),
        "master": [pc.master for pc in pieces],
        "optimizer": _optimizer_states(optimizer) + host,
    }


def _bucket_grads(buffers: list[GradBuffer]) -> list[torch.Tensor]:
    """ZeRO-2: each bucket's full-size gradient storage (resized to 0 while not in use)."""
    return [k.grad for b in buffers if b.sharded_grads for k in b.buckets]


def state_bytes(tensors: dict[str, list[torch.Tensor]], device_type: str | None = None):
    """{term: bytes} of `tensors` (a *_state_tensors dict): unique storages, each counted in
    the first term that holds it (an fp32 master that is the weight itself counts once)."""
    seen: set[int] = set()
    return {k: storage_bytes(tensors[k], seen, device_type) for k in TERMS}


def sharded_state_bytes(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    device_type: str | None = None,
    unsharded_grad_bytes: int = 0,
    masters=(),
) -> dict[str, int]:
    """{term: bytes} of sharded_state_tensors, optionally only on devices of `device_type`;
    plus, with `unsharded_grad_bytes` (the reduce dtype's size under gradient accumulation, see
    the module docstring), the unsharded gradients FSDP2 keeps between microbatches."""
    out = state_bytes(sharded_state_tensors(params, optimizer, masters), device_type)
    mine = [p for p in params if device_type is None or p.device.type == device_type]
    out["grads"] += unsharded_grad_bytes * sum(p.numel() for p in mine)  # DTensor: whole
    return out


def buffer_state_bytes(
    buffers: list[GradBuffer],
    pieces: list[Piece],
    optimizer: torch.optim.Optimizer,
    device_type: str | None = None,
    swap=None,
) -> dict[str, int]:
    """{term: bytes} of buffer_state_tensors (ZeRO-2: the shards, plus the buckets that can
    be alive at once, see the module docstring), optionally only on devices of `device_type`."""
    tensors = buffer_state_tensors(buffers, pieces, optimizer, swap)
    in_use = {id(t) for t in _bucket_grads(buffers)}  # counted by in_flight_bound
    tensors["grads"] = [t for t in tensors["grads"] if id(t) not in in_use]
    out = state_bytes(tensors, device_type)
    mine = [b for b in buffers if device_type is None or b.param_data.device.type == device_type]
    out["grads"] += in_flight_bound(mine)
    return out


BUCKETS_IN_FLIGHT = 2  # ZeRO-2, per reduction group: one reduce-scattering, one accumulating


def zero2_in_flight(num_params: int, bucket_size: int, largest_param: int = 0) -> int:
    """Elements of ZeRO-2's full-size gradient buckets alive at once for a reduction group of
    `num_params` on a rank (an upper bound): BUCKETS_IN_FLIGHT buckets, each fewer than
    bucket_size + largest_param elements (a bucket closes at the parameter that takes it to
    bucket_size), never more than the group's parameters."""
    per_bucket = bucket_size + max(largest_param - 1, 0)
    return min(num_params, BUCKETS_IN_FLIGHT * per_bucket)


def formula_bytes(
    num_params: int,
    precision: str,
    zero_stage: int,
    n: int,
    *,
    in_flight: float = 0.0,
    microbatches: int = 1,
    reduce_bytes: int = 4,
    optimizer: OptimizerSpec = ADAMW,
) -> dict[str, float]:
    """The table above for `num_params` parameters on a rank (no padding) and `optimizer`'s
    states, with the step's transient gradients (module docstring): ZeRO-2's `in_flight`
    bucket elements (fp32, `zero2_in_flight`); ZeRO-3 with `microbatches` > 1 the unsharded
    gradients, `reduce_bytes` per parameter."""
    shard = 1.0 / n if zero_stage >= 1 else 1.0
    states = optimizer.state_bytes * num_params * shard
    if zero_stage == 3:  # the fp32 shards are the weights and the masters
        unsharded = reduce_bytes * num_params if microbatches > 1 else 0.0
        whole = 0.0 if optimizer.elementwise else 4 * num_params * shard  # the owners' copies
        # (a whole-matrix spec: the owners' whole gradients during the step, as many again)
        return {"weights": 4 * num_params * shard,
                "grads": 4 * num_params * shard + unsharded + whole,
                "master": whole, "optimizer": states}  # fmt: skip
    weight = 2 if precision == "bf16" else 4
    sharded_grads = zero_stage == 2 and optimizer.elementwise
    grads = 4 * num_params * shard if sharded_grads else 4.0 * num_params
    if sharded_grads and n > 1:  # (one shard: the whole buffer, nothing extra)
        grads += 4 * in_flight
    return {
        "weights": weight * num_params,
        "grads": grads,
        "master": (4 * num_params * shard) if precision == "bf16" else 0.0,
        "optimizer": states,
    }


@dataclass(frozen=True)
class GroupSplit:
    """A rank's parameters of one reduction group (dense or expert; its TP/PP/EP shard) by how
    the optimizer's groups step them (optimizer_spec.ParamGroup): flat ZeRO shards for the
    elementwise groups, whole parameters on owner ranks for the others (whole_matrix.py)."""

    flat: int = 0  # elements of the elementwise groups' parameters
    flat_state: int = 0  # their optimizer-state bytes (Σ group_state_bytes · elements)
    whole: int = 0  # elements of the whole-matrix groups' parameters, all of them
    owned: int = 0  # of those, the elements this rank owns (ZeRO-0: all)
    owned_state: int = 0  # the owned ones' optimizer-state bytes


def split_formula_bytes(
    split: GroupSplit,
    precision: str,
    zero_stage: int,
    n: int,
    *,
    in_flight: float = 0.0,
    microbatches: int = 1,
    reduce_bytes: int = 4,
) -> dict[str, float]:
    """formula_bytes for an optimizer whose groups differ (train.optimizer=muon): the flat
    groups as the table, with their own state bytes; the whole-matrix groups' gradients whole
    (4 bytes per element, ZeRO-2 too), their fp32 masters (bf16) and states only on the owner.
    ZeRO-3: the owner's fp32 whole copies (master) and the whole gradients it holds until its
    step (grads, fsdp_whole_matrix.py). `in_flight`: ZeRO-2's buckets of the flat groups."""
    total, shard = split.flat + split.whole, (1.0 / n if zero_stage >= 1 else 1.0)
    states = split.flat_state * shard + split.owned_state
    if zero_stage == 3:
        unsharded = reduce_bytes * total if microbatches > 1 else 0.0
        return {"weights": 4 * total * shard,
                "grads": 4 * total * shard + unsharded + 4 * split.owned,
                "master": 4.0 * split.owned, "optimizer": states}  # fmt: skip
    sharded_grads = zero_stage == 2
    grads = 4.0 * split.whole + 4 * split.flat * (shard if sharded_grads else 1.0)
    if sharded_grads and n > 1:
        grads += 4 * in_flight
    master = 4 * (split.flat * shard + split.owned) if precision == "bf16" else 0.0
    weight = 2 if precision == "bf16" else 4
    return {"weights": weight * total, "grads": grads, "master": master, "optimizer": states}
