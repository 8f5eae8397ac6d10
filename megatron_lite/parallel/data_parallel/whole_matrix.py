"""ZeRO-1/2 for the parameters whose update needs whole matrices (a group of an
`OptimizerSpec` that is not elementwise, e.g. Muon's orthogonalized update): Megatron's
layer-wise distributed optimizer. The flat `[lo, hi)` shards of ddp.py cut matrices across
ranks, so these parameters live in gradient buffers of their own (ddp.py), where:

- gradients are all-reduced whole (the buffers as under ZeRO-0), so every rank of a reduction
  group holds each reduced gradient whole; ZeRO-2's sharded gradients do not apply to them
  (4 bytes per element, as stage 1, memory.py);
- each parameter is owned by one rank of its reduction group (dp×cp, or edp for experts),
  balanced by the spec's cost of its update (`OptimizerSpec.cost`, Muon's Newton–Schulz FLOPs;
  elements when it has none): largest first, each to the least-loaded rank so far (ties: the
  lower rank), over all the rank's chunks (Graham's LPT rule: within 4/3 of the best largest
  load). Every rank computes the same table, so TP peers own the same parameter's shards;
- a rank keeps fp32 masters and optimizer states only for the parameters it owns (about 1/N),
  steps them whole, and each parameter is then broadcast from its owner over the group
  (comm stats kind "broadcast_dp": each parameter's bytes once per step).

The spec's elementwise groups (Muon's AdamW) keep the usual flat shards in the other buffers.
The sums over TP (sequence-parallel replicas) and over the embedding group (tied embeddings)
run on every whole gradient before the update, so every rank takes part whatever it owns; the
gradient norm counts each owned element once. With hybrid sharding (dp_shard) the whole
parameters are owned over the whole group (the flat shards are hybrid); optimizer offload is
refused for such specs (arguments.check_optimizer).

ZeRO-3 (FSDP2 keeps rows of each matrix on each rank) gathers each such parameter whole to its
owner every step instead: fsdp_whole_matrix.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel import mappings
from megatron_lite.parallel.data_parallel.buffers import GradBuffer
from megatron_lite.parallel.data_parallel.finalize import LocalGrad
from megatron_lite.parallel.data_parallel.optimizer import Piece


def least_loaded(loads: list, cost) -> int:
    """The rank with the smallest load so far (ties: the lower rank), charged `cost`."""
    rank = min(range(len(loads)), key=lambda k: (loads[k], k))
    loads[rank] += cost
    return rank


def owner_table(params: list, n: int, cost) -> list[int]:
    """Each parameter's owner among n ranks: largest `cost(param)` first, each to the
    least-loaded rank so far (ties: the lower rank; the same table on every rank)."""
    costs = [cost(p) for p in params]
    order = sorted(range(len(params)), key=lambda i: (-costs[i], i))
    loads, owner = [0] * n, [0] * len(params)
    for i in order:
        owner[i] = least_loaded(loads, costs[i])
    return owner


def assign_owners(buffers: list[GradBuffer], groups: list[str], cost=None) -> dict[int, int]:
    """{id(param): its owner's rank in its buffer's group}: per reduction group (`groups[i]`
    names buffers[i]'s), by `owner_table` with `cost` (the spec's, `OptimizerSpec.cost`;
    None: elements)."""
    owners: dict[int, int] = {}
    for name in dict.fromkeys(groups):
        mine = [b for b, g in zip(buffers, groups, strict=True) if g == name]
        params = [r.param for b in mine for r in b.ranges.values()]
        table = owner_table(params, mappings.size(mine[0].group), cost or (lambda p: p.numel()))
        owners.update({id(p): r for p, r in zip(params, table, strict=True)})
    return owners


def whole_pieces(buffers: list[GradBuffer], owners: dict[int, int] | None) -> list[Piece]:
    """One piece per parameter this rank owns (`owners` None: every parameter, ZeRO-0), whole
    and in its own shape; the master is the parameter's data when it is fp32, else a copy."""
    pieces = []
    for buf in buffers:
        me = dist.get_rank(buf.group) if mappings.size(buf.group) > 1 else 0
        for r in buf.ranges.values():
            if owners is not None and owners[id(r.param)] != me:
                continue
            lo, hi = r.start, r.start + r.param.numel()
            data = buf.param_data[lo:hi].view(r.param.shape)
            copy = data.dtype != torch.float32
            if copy:
                data = data.to(torch.float32, copy=True)
            master = torch.nn.Parameter(data)
            pieces.append(Piece(buf, r.param, lo, hi, lo, master, not copy, owners is not None))
    return pieces


def whole_grads(buffers: list[GradBuffer]) -> list[LocalGrad]:
    """Every parameter's whole reduced gradient on this rank (the TP and tied sums run on
    these, so every rank takes part)."""
    out = []
    for buf in buffers:
        for r in buf.ranges.values():
            grad = buf.grad_data[r.start : r.start + r.param.numel()]
            out.append(LocalGrad(r.param, grad, buf.replicas))
    return out


def broadcast_params(buffers: list[GradBuffer], owners: dict[int, int]) -> None:
    """Every parameter from its owner to the other ranks of its buffer's group (after the
    owners' step), all in flight together (comm stats kind "broadcast_dp")."""
    works = []
    for buf in buffers:
        if mappings.size(buf.group) == 1:
            continue
        ranks = dist.get_process_group_ranks(buf.group)
        for r in buf.ranges.values():
            data = buf.param_data[r.start : r.start + r.param.numel()]
            src = ranks[owners[id(r.param)]]
            works.append(mappings.broadcast_async(data, src, buf.group, kind="broadcast_dp"))
    for work in works:
        work.wait()
