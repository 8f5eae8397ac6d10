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


def _bytes(tensors, seen: set[int], device_type: str | None = None) -> int:
    total = 0
    for t in tensors:
        if device_type is not None and t.device.type != device_type:
            continue  # e.g. the offloaded masters and moments when counting the GPU's bytes
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # a DTensor counts its shard


def sharded_state_bytes(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    device_type: str | None = None,
) -> dict[str, int]:
    """{term: bytes} of ZeRO-3 (FSDP2) model states on this rank: the local shards of the
    parameters (fp32: also the master weights), their gradients and the AdamW states."""
    seen: set[int] = set()
    out = {"weights": _bytes([_local(p) for p in params], seen, device_type)}
    grads = [_local(p.grad) for p in params if p.grad is not None]
    out["grads"] = _bytes(grads, seen, device_type)
    out["master"] = 0
    states = [_local(t) for s in optimizer.state.values() for t in s.values()]
    out["optimizer"] = _bytes([t for t in states if t.dim() > 0], seen, device_type)
    return out


def buffer_state_bytes(
    buffers: list[GradBuffer],
    pieces: list[Piece],
    optimizer: torch.optim.Optimizer,
    device_type: str | None = None,
) -> dict[str, int]:
    """{term: bytes} of ZeRO-0/1/2 model states on this rank (unique storages): the parameter
    and gradient buffers (and ZeRO-2 shards), the pieces' fp32 masters, the AdamW states; all
    of them or only those on devices of `device_type`."""
    seen: set[int] = set()
    out = {"weights": _bytes([b.param_data for b in buffers], seen, device_type)}
    grads = [b.grad_data for b in buffers] + [b.grad_shard for b in buffers]
    out["grads"] = _bytes(grads, seen, device_type)
    out["master"] = _bytes([pc.master for pc in pieces], seen, device_type)
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    out["optimizer"] = _bytes(states, seen, device_type)
    return out


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
