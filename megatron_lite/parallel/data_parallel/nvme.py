"""NVMe offload of the optimizer (`offload="nvme"`, train.optimizer_offload=nvme): each piece's
fp32 master and optimizer states (AdamW: exp_avg, exp_avg_sq) live in this rank's swap file
(nvme_io.py), not in memory; the step reads them in group by group into a bounded host buffer,
steps the group, writes it back, and reads the next group while this one steps.

Layout: pieces (optimizer.py: a parameter ∩ this rank's shard) are cut into groups of
consecutive pieces of at most half the buffer each (a piece larger than that is a group alone,
up to the whole buffer). A group is one contiguous range of the file and of the buffer:
per piece [master | state 1 | ... | state K], n fp32 elements each, so a group moves in a few
large reads and writes (IO_CHUNK each, several in flight on the pool).

The buffer is a ring (`Ring`): groups take space in step order and give it back in that order
when their write-back has finished. The step (`NvmeStates.step`):

    read g0
    for each group i:   wait read i; read i+1 into free space (waiting for the oldest
                        write-backs until it fits, or after step i when only i's space is
                        left); step i: bind the masters and states to buffer views, give the
                        masters their gradients, the torch optimizer steps (a piece without
                        .grad is skipped, so one optimizer steps one group at a time); copy the
                        masters into the weights; write i back (asynchronously)
    wait every write

The arithmetic is the torch optimizer's on the same tensors (whole pieces, per tensor on CPU)
as under CPU offload, so the results are bitwise those. The step counts ("step", 0-d) stay in
memory. Between steps the masters and states are empty tensors (0 bytes).

Checkpoints never read the file directly: `staged()` reads every piece's states into fresh host
tensors (`ShardedOptimizer.state_shards` returns them: a save writes from them, a load fills
them) and `commit()` writes loaded ones back. A save therefore holds this rank's states in host
memory for its duration (the one time they are all resident).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from megatron_lite.parallel.data_parallel.nvme_io import SwapFile, wait
from megatron_lite.parallel.data_parallel.optimizer_spec import group_index

F32 = 4  # bytes per element of a master or a state


@dataclass(frozen=True)
class Group:
    """Pieces [first, last) in one contiguous range: `offset` (bytes, the file) and `nbytes`."""

    first: int
    last: int
    offset: int
    nbytes: int


def plan_groups(piece_bytes: Sequence[int], buffer_bytes: int) -> list[Group]:
    """Consecutive pieces in groups of at most buffer_bytes // 2 (one larger piece alone:
    it must fit the buffer, `largest_piece_problem`), laid out back to back in the file."""
    groups, first, size, offset = [], 0, 0, 0
    half = buffer_bytes // 2
    for i, b in enumerate(piece_bytes):
        if size and size + b > half:
            groups.append(Group(first, i, offset, size))
            first, offset, size = i, offset + size, 0
        size += b
    if size:
        groups.append(Group(first, len(piece_bytes), offset, size))
    return groups


def largest_piece_problem(piece_bytes: Sequence[int], buffer_bytes: int) -> str | None:
    """The rule on nvme_buffer_mb: the largest piece's master and states fit the buffer."""
    largest = max(piece_bytes, default=0)
    if largest <= buffer_bytes:
        return None
    return (
        f"the buffer ({buffer_bytes / 2**20:.1f} MiB) must hold the largest piece's fp32 master "
        f"and optimizer states, {largest / 2**20:.1f} MiB (read in whole for its step)"
    )


class Ring:
    """FIFO allocations of element ranges of a buffer of `capacity` elements."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.live: deque[tuple[int, int]] = deque()  # (start, size), oldest first

    def fits(self, size: int) -> int | None:
        """Where `size` elements would go now, None when they do not fit."""
        if not self.live:
            return 0 if size <= self.capacity else None
        head, (s, n) = self.live[0][0], self.live[-1]
        tail = s + n
        if tail > head:  # not wrapped: room after the newest, or before the oldest
            if tail + size <= self.capacity:
                return tail
            return 0 if size <= head else None
        return tail if tail + size <= head else None

    def take(self, size: int) -> int:
        start = self.fits(size)
        assert start is not None, "Ring.take without room (fits() first)"
        self.live.append((start, size))
        return start

    def give_back(self) -> None:
        self.live.popleft()


class NvmeStates:
    """The swap of `pieces`' masters and states (module docstring). `names[i]`: piece i's
    state names in order; `numels[i]`: its elements; `buffer_bytes`: the host buffer."""

    def __init__(self, root: str, rank: int, numels: list[int], names: list[tuple[str, ...]],
                 buffer_bytes: int, pin: bool):  # fmt: skip
        self.numels, self.names = numels, names
        sizes = [n * (1 + len(k)) * F32 for n, k in zip(numels, names, strict=True)]
        if problem := largest_piece_problem(sizes, buffer_bytes):
            raise ValueError(f"nvme_buffer_mb: {problem}")  # the builder checked it already
        self.groups = plan_groups(sizes, buffer_bytes)
        self.offsets = []  # each piece's byte offset in the file
        for g in self.groups:
            at = g.offset
            for i in range(g.first, g.last):
                self.offsets.append(at)
                at += sizes[i]
        self.file = SwapFile(root, rank, sum(sizes))
        self.buffer = torch.empty(buffer_bytes // F32, dtype=torch.float32, pin_memory=pin)
        self.ring = Ring(self.buffer.numel())
        self.empty = torch.empty(0, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        """Bytes of the swap file."""
        return self.file.nbytes

    def _views(self, i: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Piece i's [master, *states] as views of `flat`, its slice of a group's buffer."""
        n = self.numels[i]
        return [flat[k * n : (k + 1) * n] for k in range(1 + len(self.names[i]))]

    def _start_read(self, g: Group) -> tuple[int, list[Future]]:
        start = self.ring.take(g.nbytes // F32)
        region = self.buffer[start : start + g.nbytes // F32]
        return start, self.file.submit(False, region, g.offset)

    def step(self, step_group) -> None:
        """One optimizer step over every group: `step_group(first, last, views)` binds, steps
        and writes back the weights of pieces [first, last) whose [master, *states] are
        `views` (one list per piece)."""
        self.file.check()
        writes: deque[list[Future]] = deque()  # the groups in the ring, oldest first
        reads = {0: self._start_read(self.groups[0])} if self.groups else {}
        try:
            for i, g in enumerate(self.groups):
                start, pending = reads.pop(i)
                wait(pending)
                if i + 1 < len(self.groups):
                    self._prefetch(i + 1, writes, reads)
                region = self.buffer[start : start + g.nbytes // F32]
                views, at = [], 0
                for p in range(g.first, g.last):
                    n = self.numels[p] * (1 + len(self.names[p]))
                    views.append(self._views(p, region[at : at + n]))
                    at += n
                step_group(g.first, g.last, views)
                writes.append(self.file.submit(True, region, g.offset))
                if i + 1 < len(self.groups) and i + 1 not in reads:  # only i's space was left
                    self._prefetch(i + 1, writes, reads)
        finally:  # every read and write finished before the buffer is reused or an error out
            in_flight = [f for w in writes for f in w] + [f for _, r in reads.values() for f in r]
            self.ring.live.clear()
            wait(in_flight)

    def _prefetch(self, j: int, writes: deque, reads: dict) -> None:
        """Start reading group j once it fits, waiting for the oldest write-backs to free
        space; when none is left to wait for (the group being stepped holds the rest), leave
        it for later."""
        size = self.groups[j].nbytes // F32
        while self.ring.fits(size) is None:
            if not writes:
                return
            wait(writes.popleft())
            self.ring.give_back()
        reads[j] = self._start_read(self.groups[j])

    # ------------------------------------------------------------ outside the step
    def _piece_elements(self, i: int) -> int:
        return self.numels[i] * (1 + len(self.names[i]))

    def read_pieces(self) -> list[list[torch.Tensor]]:
        """Every piece's [master, *states] read into fresh host tensors (checkpoints)."""
        self.file.check()
        out = []
        for i in range(len(self.numels)):
            flat = torch.empty(self._piece_elements(i), dtype=torch.float32)
            self.file.read_now(flat, self.offsets[i])
            out.append(self._views(i, flat))
        return out

    def write_pieces(self, pieces: list[list[torch.Tensor]], masters: bool = True) -> None:
        """Store `read_pieces`-shaped tensors back (after a load filled them); `masters`:
        their masters too (else only the states)."""
        self.file.check()
        for i, views in enumerate(pieces):
            skip = 0 if masters else 1
            for k, t in enumerate(views[skip:], start=skip):
                self.file.write_now(t.contiguous(), self.offsets[i] + k * self.numels[i] * F32)

    def write_master(self, i: int, values: torch.Tensor) -> None:
        """Piece i's master <- `values` (its fp32 host values, n elements)."""
        self.file.write_now(values.contiguous().view(-1), self.offsets[i])

    def close(self) -> None:
        """Remove the swap file (a clean exit; also at interpreter exit)."""
        self.file.close()


@dataclass(frozen=True)
class NvmeSettings:
    """Where the swap file goes (`path`, an existing writable directory), the host buffer's
    bytes, and this rank (in the swap directory's name)."""

    path: str
    buffer_bytes: int
    rank: int


def swapped_bytes(pieces, spec, hyper) -> list[int]:
    """Each piece's master and optimizer-state bytes in the swap file (fp32 each: a spec with
    states of another dtype is refused by `ShardedOptimizer`)."""
    groups, out = spec.param_groups(hyper), []
    for pc in pieces:
        name = pc.buffer.names.get(id(pc.param), "")
        group = groups[group_index(spec, groups, pc.param, name)]
        out.append((pc.hi - pc.lo) * (1 + len(spec.group_states(group))) * F32)
    return out
