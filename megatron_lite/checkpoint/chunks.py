"""What DCP writes and reads on one rank: chunks of logical tensors, as views of the tensors the
rank already holds (nothing is assembled first).

A rank holds elements [lo, hi) of a parameter's flattened TP-local tensor: all of it (the
weights in stages 0-2, ZeRO-0's optimizer state), a ZeRO-1/2 shard (a bucket's 1/N cut through
the parameter) or its FSDP2 rows (ZeRO-3). `flat_boxes` tiles such a range with at most
2·ndim - 1 boxes (a partial first row, whole rows, a partial last row, recursively), `chunks_of`
cuts them along the parameter's logical pieces (state.param_pieces: TP offsets, fused segments,
vocabulary padding dropped), and `Chunk.view` is each one as a strided view of the held tensor.
DCP stores each as a chunk at its offsets of the logical tensor, so any other layout reads the
overlap it needs (resharding), and a load writes straight into the views.

The planners key their state dicts by any name and take the logical tensor's name from the
`Piece` (or `Chunk`) given for it, so one rank may write or read several chunks of one tensor.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_lite.atomic import write_failure
from megatron_lite.checkpoint.state import param_pieces
from megatron_lite.parallel.params import ParamMeta

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, sizes) in a tensor's index space


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Boxes that tile the elements [lo, hi) of a C-contiguous tensor of `shape`, in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    (a, la), (b, lb) = divmod(lo, inner), divmod(hi, inner)

    def in_row(row: int, start: int, end: int) -> list[Box]:
        return [((row, *s), (1, *z)) for s, z in flat_boxes(shape[1:], start, end)]

    if a == b:
        return in_row(a, la, lb)
    out = []
    if la:  # the first row's tail
        out += in_row(a, la, inner)
        a += 1
    if b > a:
        out.append(((a, *(0,) * (len(shape) - 1)), (b - a, *shape[1:])))
    if lb:  # the last row's head
        out += in_row(b, 0, lb)
    return out


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A box of the logical tensor `key` (of `global_shape`) at `offsets`, of `sizes`, that
    starts at index `start` of the TP-local tensor (of `shape`)."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: tuple[int, ...]
    shape: tuple[int, ...]

    def view(self, flat: torch.Tensor, lo: int) -> torch.Tensor:
        """This chunk of `flat`, a contiguous tensor holding elements [lo, ...) of the
        flattened TP-local tensor (a view: reading into it writes the holder)."""
        strides = [math.prod(self.shape[i + 1 :]) for i in range(len(self.shape))]
        at = sum(s * st for s, st in zip(self.start, strides, strict=True)) - lo
        return flat.as_strided(self.sizes, strides, flat.storage_offset() + at)

    def with_key(self, key: str) -> Chunk:
        return dataclasses.replace(self, key=key)


def chunks_of(name: str, meta: ParamMeta, shape: tuple[int, ...], lo: int, hi: int):
    """The chunks of logical tensors that elements [lo, hi) of parameter `name`'s flattened
    TP-local tensor (of `shape`) hold; vocabulary padding falls outside every chunk."""
    out = []
    for start, sizes in flat_boxes(tuple(shape), lo, hi):
        for piece in param_pieces(name, meta):
            s, z, d = list(start), list(sizes), piece.dim
            if d is not None:  # the piece is rows [start, start + length) along d
                a, b = max(s[d], piece.start), min(s[d] + z[d], piece.start + piece.length)
                if a >= b:
                    continue
                s[d], z[d] = a, b - a
            offsets = tuple(
                o + s[i] - (piece.start if i == d else 0) for i, o in enumerate(piece.offsets)
            )
            out.append(Chunk(piece.key, piece.global_shape, offsets, tuple(z), tuple(s), shape))
    return out


@dataclasses.dataclass(frozen=True)
class Cast:
    """`source` stored in `dtype`, cast only when DCP writes (or stages) it: one chunk at a
    time (ZeRO-3's bf16 weights, whose resident copy is the fp32 shard)."""

    source: torch.Tensor
    dtype: torch.dtype

    def __call__(self) -> torch.Tensor:
        return self.source.to(self.dtype)


def materialize(value) -> torch.Tensor:
    return value() if isinstance(value, Cast) else value


class DiskWriter(FileSystemWriter):
    """A FileSystemWriter whose failed writes raise the OSError that names the file and the
    OS's reason ("No space left on device"), where torch's serializer says "enforce fail"."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as e:  # this rank's data file (single_file_per_rank): __<rank>_0
            prefix = getattr(plan.storage_data, "prefix", None)
            file = os.path.join(self.path, f"{prefix}0.distcp" if prefix else "")
            raise write_failure(e, file) or e from None

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:  # the coordinator's DCP index
            raise write_failure(e, os.path.join(self.path, ".metadata")) or e from None


class StagingWriter(DiskWriter):
    """A FileSystemWriter whose async staging copies each value (a `Cast` made first) to a new
    host tensor, one at a time: what is staged is exactly the chunks this rank writes."""

    def stage(self, state_dict: dict) -> dict:
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the state is on the host now
        return {k: materialize(v).detach().to("cpu", copy=True) for k, v in state_dict.items()}


class ShardSavePlanner(DefaultSavePlanner):
    """Writes each value of the state dict as the chunk `pieces[key]` describes (its `key` is
    the logical tensor, its `offsets` where the value sits in it); values may be `Cast`."""

    def __init__(self, pieces: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces
        self._names: dict[tuple, str] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            piece = self.pieces[key]
            offsets = torch.Size(piece.offsets)
            self._names[(piece.key, tuple(offsets))] = key
            if isinstance(value, Cast):
                sizes, properties = value.source.size(), TensorProperties(dtype=value.dtype)
            else:
                sizes, properties = value.size(), TensorProperties.create_from_tensor(value)
            data = TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=properties,
                size=torch.Size(piece.global_shape),
            )
            index = MetadataIndex(piece.key, offsets)
            items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return materialize(self.state_dict[self._names[(index.fqn, tuple(index.offset))]])


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads into each value of the state dict the overlap of the chunk `pieces[key]`
    describes with whatever chunks were saved."""

    def __init__(self, pieces: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces
        self._names: dict[tuple[str, int], str] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        by_tensor: dict[str, list[str]] = {}
        for key in self.state_dict:
            by_tensor.setdefault(self.pieces[key].key, []).append(key)
        items = []
        for fqn, keys in by_tensor.items():
            local = []
            for i, key in enumerate(keys):
                offsets = torch.Size(self.pieces[key].offsets)
                local.append(ChunkStorageMetadata(offsets, self.state_dict[key].size()))
                self._names[(fqn, i)] = key
            stored = self.metadata.state_dict_metadata[fqn]
            items += create_read_items_for_chunk_list(fqn, stored, local)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[self._names[(index.fqn, index.index)]]
