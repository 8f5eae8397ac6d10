"""Fully parallel load: every checkpoint tensor a replica group needs is read from disk by one
of its members, then broadcast to the others, so each rank reads about 1/replicas of its
model shard instead of all of it (the load side of Megatron's fully parallel save).

The replica group of a dense parameter is `mesh.dp_cp` (the ranks of one TP rank and pipeline
stage: they hold the same weights and, whole, the same optimizer state), of an expert one
`mesh.edp`. Each member computes the same assignment from the parameters' names and local
sizes (every member has the same), largest first to the least-loaded member, so the reads
are balanced without a collective to agree on them. Each member then broadcasts what it read,
one flat tensor per dtype, to the rest of its group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.parallel.mappings import guarded


@dataclass(frozen=True)
class ParamKeys:
    """The load buffers (checkpoint keys) of one parameter and whether it is an expert's."""

    keys: tuple[str, ...]
    is_expert: bool


def assign_readers(sizes: list[int], members: int) -> list[int]:
    """Member index reading each item of byte size `sizes[i]`: largest first, to the
    least-loaded member (ties: lowest index), the same table on every member."""
    loads = [0] * members
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        best = min(range(members), key=lambda m: (loads[m], m))
        owner[i] = best
        loads[best] += sizes[i]
    return owner


class ParallelRead:
    """Which of this rank's load buffers it reads itself (`mine`), and `exchange()`, which
    fills in the others from the members that read them (collective over the replica
    groups). Keys outside `params` (the RNG states) are always read by their own rank."""

    def __init__(self, buffers: dict[str, torch.Tensor], params: list[ParamKeys], mesh):
        self.plans = []  # (Group, [(member, [keys])]) for each replica group with > 1 member
        listed = {k for p in params for k in p.keys}
        self.mine = {k for k in buffers if k not in listed}
        for is_expert in (False, True):
            group = mesh.edp if is_expert else mesh.dp_cp
            mine = [p for p in params if p.is_expert == is_expert]
            if not mine:
                continue
            if group.size == 1:
                self.mine.update(k for p in mine for k in p.keys)
                continue
            sizes = [sum(buffers[k].nbytes for k in p.keys) for p in mine]
            owners = assign_readers(sizes, group.size)
            per_member = [[] for _ in range(group.size)]
            for p, owner in zip(mine, owners, strict=True):
                per_member[owner].extend(p.keys)
            self.mine.update(per_member[group.rank])
            self.plans.append((group, list(enumerate(per_member))))

    def read_bytes(self, buffers: dict[str, torch.Tensor]) -> int:
        return sum(buffers[k].nbytes for k in self.mine)

    def exchange(self, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        """Broadcast every member's reads to the rest of its group: one flat tensor per
        (member, dtype), on `device` (NCCL groups need CUDA tensors)."""
        for group, per_member in self.plans:
            for member, keys in per_member:
                by_dtype: dict[torch.dtype, list[str]] = {}
                for k in keys:
                    by_dtype.setdefault(buffers[k].dtype, []).append(k)
                for dtype in sorted(by_dtype, key=str):
                    self._broadcast(group, member, by_dtype[dtype], buffers, dtype, device)

    @staticmethod
    def _broadcast(group, member: int, keys, buffers, dtype, device) -> None:
        total = sum(buffers[k].numel() for k in keys)
        if group.rank == member:
            flat = torch.cat([buffers[k].reshape(-1) for k in keys]).to(device)
        else:
            flat = torch.empty(total, dtype=dtype, device=device)
        src = group.ranks[member]
        guarded(
            f"broadcast_checkpoint_reads from rank {src}",
            group.group,
            lambda: dist.broadcast(flat, src=src, group=group.group),
        )
        if group.rank == member:
            return
        flat = flat.cpu()
        offset = 0
        for k in keys:
            n = buffers[k].numel()
            buffers[k].copy_(flat[offset : offset + n].view_as(buffers[k]))
            offset += n
