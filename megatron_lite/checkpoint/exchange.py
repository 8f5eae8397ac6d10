"""Fully parallel load: every checkpoint tensor a replica group needs is read from disk by one
of its members, then broadcast to the others, so each rank reads about 1/replicas of what its
group holds instead of all of it (the load side of Megatron's fully parallel save).

What is shared is a list of `Shared` per family (holdings.py): the tensors of one parameter
(its weights, or one range of its AdamW state) that the ranks of `replicas` hold identically,
and the load targets that fill them. Each member computes the same assignment from the sizes
(every member holds the same units in the same order), largest first to the least-loaded
member, so the reads are balanced without a collective to agree on them. Each member then
broadcasts what it read, tensor by tensor and in place (nothing is concatenated), to the rest
of its group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.parallel.mappings import guarded
from megatron_lite.parallel.mesh import Group


@dataclass(frozen=True)
class Shared:
    """`tensors` (contiguous), filled by the load targets `keys`, held identically by every
    rank of `replicas`."""

    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    replicas: Group
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
    """Which load targets this rank reads itself (`mine`), and `exchange()`, which fills in the
    others from the members that read them (collective over the replica groups). Targets in no
    `Shared` (step counts, RNG states) are always read by their own rank."""

    def __init__(self, buffers: dict[str, torch.Tensor], families: list[list[Shared]]):
        self.plans = []  # (Group, [(member, tensors)]) for each replica group with > 1 member
        listed = {k for family in families for s in family for k in s.keys}
        self.mine = {k for k in buffers if k not in listed}
        for family in families:
            for is_expert in (False, True):
                units = [s for s in family if s.is_expert == is_expert]
                if not units:
                    continue
                group = units[0].replicas  # one group per family and kind (holdings.py)
                if group.size == 1:
                    self.mine.update(k for s in units for k in s.keys)
                    continue
                sizes = [sum(t.nbytes for t in s.tensors) for s in units]
                owners = assign_readers(sizes, group.size)
                for s, owner in zip(units, owners, strict=True):
                    if owner == group.rank:
                        self.mine.update(s.keys)
                pairs = zip(owners, (s.tensors for s in units), strict=True)
                self.plans.append((group, list(pairs)))

    def read_bytes(self, buffers: dict[str, torch.Tensor]) -> int:
        return sum(buffers[k].nbytes for k in self.mine)

    def exchange(self, device: torch.device) -> None:
        """Broadcast every member's reads to the rest of its group, each tensor in place (on
        `device`: a host tensor under NCCL goes through a device copy of itself)."""
        for group, items in self.plans:
            for member, tensors in items:
                for t in tensors:
                    _broadcast(group, member, t, device)


@torch.no_grad()
def _broadcast(group: Group, member: int, t: torch.Tensor, device: torch.device) -> None:
    payload = t if t.device.type == device.type else t.to(device)
    src = group.ranks[member]
    guarded(
        f"broadcast_checkpoint_reads from rank {src}",
        group.group,
        lambda: dist.broadcast(payload, src=src, group=group.group),
    )
    if payload is not t:
        t.copy_(payload)
