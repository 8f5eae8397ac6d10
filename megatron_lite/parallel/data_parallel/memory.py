"""Model-state memory, measured by walking the tensors actually allocated (unique storages),
and the formula it is checked against (README: "ZeRO stages").

Bytes per parameter held by this rank (its TP/PP/EP shard), with N the sharding degree:

| precision, stage | weights | grads | master | AdamW (m, v) | total    |
|------------------|---------|-------|--------|--------------|----------|
| fp32, 0          | 4       | 4     | 0      | 8            | 16       |
| fp32, 1          | 4       | 4     | 0      | 8/N          | 8 + 8/N  |
| fp32, 2          | 4       | 4/N   | 0      | 8/N          | 4 + 12/N |
| bf16, 0          | 2       | 4     | 4      | 8            | 18       |
| bf16, 1          | 2       | 4     | 4/N    | 8/N          | 6 + 12/N |
| bf16, 2          | 2       | 4/N   | 4/N    | 8/N          | 2 + 16/N |
| either, 3        | 4/N     | 4/N   | 0      | 8/N          | 16/N     |

fp32 masters are the parameters themselves (0 extra) unless the optimizer is offloaded (then
4/N on the host). Buckets are padded to a multiple of N, so a measurement can exceed the formula
by at most N - 1 elements per bucket.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from megatron_lite.parallel.data_parallel.buffers import GradBuffer
from megatron_lite.parallel.data_parallel.optimizer import Piece

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
    return t.to_local() if isinstance(t, DTensor) else t  # a DTensor counts its shard


def _optimizer_states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    states = [_local(t) for s in optimizer.state.values() for t in s.values()]
    return [t for t in states if isinstance(t, torch.Tensor) and t.dim() > 0]


def sharded_state_tensors(params, optimizer) -> dict[str, list[torch.Tensor]]:
    """{term: tensors} of ZeRO-3 (FSDP2) model states on this rank: the local shards of the
    parameters (fp32: also the master weights), their gradients and the AdamW states."""
    return {
        "weights": [_local(p) for p in params],
        "grads": [_local(p.grad) for p in params if p.grad is not None],
        "master": [],
        "optimizer": _optimizer_states(optimizer),
    }


def buffer_state_tensors(
    buffers: list[GradBuffer], pieces: list[Piece], optimizer: torch.optim.Optimizer
) -> dict[str, list[torch.Tensor]]:
    """{term: tensors} of ZeRO-0/1/2 model states on this rank: the parameter and gradient
    buffers (and ZeRO-2 shards), the pieces' fp32 masters, the AdamW states."""
    return {
        "weights": [b.param_data for b in buffers],
        "grads": [b.grad_data for b in buffers] + [b.grad_shard for b in buffers],
        "master": [pc.master for pc in pieces],
        "optimizer": _optimizer_states(optimizer),
    }


def state_bytes(tensors: dict[str, list[torch.Tensor]], device_type: str | None = None):
    """{term: bytes} of `tensors` (a *_state_tensors dict): unique storages, each counted in
    the first term that holds it (an fp32 master that is the weight itself counts once)."""
    seen: set[int] = set()
    return {k: storage_bytes(tensors[k], seen, device_type) for k in TERMS}


def sharded_state_bytes(params, optimizer, device_type: str | None = None) -> dict[str, int]:
    """{term: bytes} of sharded_state_tensors, optionally only on devices of `device_type`."""
    return state_bytes(sharded_state_tensors(params, optimizer), device_type)


def buffer_state_bytes(
    buffers: list[GradBuffer],
    pieces: list[Piece],
    optimizer: torch.optim.Optimizer,
    device_type: str | None = None,
) -> dict[str, int]:
    """{term: bytes} of buffer_state_tensors, optionally only on devices of `device_type`."""
    return state_bytes(buffer_state_tensors(buffers, pieces, optimizer), device_type)


def formula_bytes(num_params: int, precision: str, zero_stage: int, n: int) -> dict[str, float]:
    """The table above for `num_params` parameters on a rank (no padding)."""
    shard = 1.0 / n if zero_stage >= 1 else 1.0
    if zero_stage == 3:  # the fp32 shards are the weights and the masters
        return {"weights": 4 * num_params * shard, "grads": 4 * num_params * shard,
                "master": 0.0, "optimizer": 8 * num_params * shard}  # fmt: skip
    weight = 2 if precision == "bf16" else 4
    return {
        "weights": weight * num_params,
        "grads": 4 * num_params * (shard if zero_stage >= 2 else 1.0),
        "master": (4 * num_params * shard) if precision == "bf16" else 0.0,
        "optimizer": 8 * num_params * shard,
    }
