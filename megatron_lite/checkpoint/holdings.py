"""What this rank holds of a checkpoint's tensors, who of its replicas writes each, and the save
and load state built from them: views of the tensors the rank already holds, nothing assembled.

A `Unit` is one parameter's tensors over one range of its flattened TP-local tensor, held
identically by the ranks of `replicas`:
- weights, stages 0-2: the whole parameter, over dp·cp (edp for experts);
- weights, stage 3: this rank's FSDP2 rows (the fp32 shard, stored in the compute dtype as the
  model and, when that is not fp32, as the fp32 master too), over HSDP's replicas;
- optimizer state (`optimizer.state_shards()`): its spec's states (and masters kept apart) of the
  range this rank steps (NVMe offload: host copies read from the swap file, written back after a
  load by `commit_loaded_states`; a save never depends on the swap file existing later): whole
  under ZeRO-0 (over dp·cp), a bucket shard under ZeRO-1/2, the
  FSDP2 rows under ZeRO-3 (over the hybrid-sharding replicas, if any).
Each unit is written by one of its copies (`writer_names`, per family) and, on load, read by
one (`exchange.assign_readers`) and broadcast in place to the others.

Memory of a save or a load beyond the model states already resident (the bound
tests/parallel/test_checkpoint_memory.py checks):
- save: on the device at most one chunk at a time, and nothing but stage 3's bf16 weights (cast
  one chunk at a time as DCP writes them; every other chunk is a view). On the host only the
  chunks this rank writes, about 1/(dp·cp) of its TP/PP-local model and AdamW state: DCP's
  writer copies each to the host (or clones a view of a larger storage) as it writes it and
  keeps it until its file is closed; an async save stages exactly those chunks.
- load: on the host one stored chunk at a time (read, then copied into the views in place);
  nothing on the device (the exchange broadcasts in place; host-offloaded AdamW state goes
  through a device copy of one tensor at a time); besides, DCP's pickled plans, a 4-byte step
  count per parameter and the RNG states.
A chunk is part of one parameter's TP-local tensor and a bucket holds whole parameters, so a
chunk is at most one bucket of fp32 (stage 3, which has no buckets: one parameter) of the
layout that saved it.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_lite.checkpoint.chunks import Cast, Chunk, chunks_of
from megatron_lite.checkpoint.exchange import ParallelRead, Shared
from megatron_lite.checkpoint.state import (
    Piece,
    logical_name,
    named_parameters,
    rng_states,
    writer_names,
)
from megatron_lite.parallel.mesh import Group
from megatron_lite.parallel.params import ParamMeta, fsdp_replicas, fsdp_rows

MODEL, MASTER = "model", "optim/master"


def state_kinds(optimizer) -> tuple[str, ...]:
    """The slot kinds of the optimizer's states (`optim/<name>`, its spec's state names)."""
    return tuple(f"optim/{k}" for k in optimizer.spec.state_names)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor of a unit: `data` (contiguous) stored as `kind` in `dtype`."""

    kind: str
    data: torch.Tensor
    dtype: torch.dtype


@dataclasses.dataclass
class Unit:
    """Parameter `name`'s tensors over elements [lo, hi) of its flattened TP-local tensor,
    identical on every rank of `replicas`; `chunks` is where that range sits in the logical
    tensors; `step` the optimizer's step count of an optimizer unit."""

    name: str
    meta: ParamMeta
    lo: int
    hi: int
    slots: list[Slot]
    replicas: Group
    chunks: list[Chunk]
    step: torch.Tensor | None = None

    def writes_step(self) -> bool:
        """Whether this unit's writer stores the step count: it starts the parameter (one
        unit does, on the TP rank holding each logical tensor's first block)."""
        return (
            self.step is not None and self.lo == 0 and any(not any(c.offsets) for c in self.chunks)
        )


def replicas_of(group: dist.ProcessGroup | None, name: str) -> Group:
    """`group` as a mesh Group (None: this rank alone)."""
    if group is None or dist.get_world_size(group) == 1:
        return Group(name, None, (dist.get_rank(),), 0)
    return Group(name, group, tuple(dist.get_process_group_ranks(group)), dist.get_rank(group))


def holdings(chunks, optimizer, mesh) -> list[list[Unit]]:
    """This rank's units in three families, each dealt to writers and readers on its own:
    whole weights (stages 0-2), FSDP2 weight rows (stage 3), optimizer state."""
    shards = {}
    for s in optimizer.state_shards():  # one range per parameter: a bucket holds it whole
        if shards.setdefault(id(s.param), s) is not s:
            raise RuntimeError("state_shards: two ranges of one parameter on one rank")
    whole, rows_, states = [], [], []
    for name, p in named_parameters(chunks):
        meta, shape = p.meta, tuple(p.shape)
        rows = fsdp_rows(p)
        if rows is None:  # whole on every rank of dp·cp (edp)
            data, lo, hi = p.data.view(-1), 0, p.numel()
            group = mesh.edp if meta.is_expert else mesh.dp_cp
            slots, family = [Slot(MODEL, data, p.dtype)], whole
        else:  # this rank's FSDP2 rows, the fp32 masters
            inner = math.prod(shape[1:])
            data, lo, hi = p.to_local().detach().view(-1), rows[0] * inner, rows[1] * inner
            slots = [Slot(MODEL, data, optimizer.weight_dtype), Slot(MASTER, data, torch.float32)]
            group, family = replicas_of(fsdp_replicas(p), "fsdp_replicas"), rows_
        if hi > lo:
            found = chunks_of(name, meta, shape, lo, hi)
            family.append(Unit(name, meta, lo, hi, slots, group, found))
        s = shards.get(id(p))
        if s is not None and s.hi > s.lo:
            slots = [Slot(f"optim/{k}", t.view(-1), torch.float32) for k, t in s.states.items()]
            group = replicas_of(s.replicas, "state_replicas")
            found = chunks_of(name, meta, shape, s.lo, s.hi)
            states.append(Unit(name, meta, s.lo, s.hi, slots, group, found, s.step))
    return [whole, rows_, states]


def _written(family: list[Unit], mesh) -> list[Unit]:
    """The units of one family this rank writes: `writer_names` over the family's replicas
    (dense units share one group, expert units another) × the TP ranks where replicated."""
    one = Group("self", None, (dist.get_rank(),), 0)
    dense = next((u.replicas for u in family if not u.meta.is_expert), one)
    expert = next((u.replicas for u in family if u.meta.is_expert), one)
    coords = SimpleNamespace(tp=mesh.tp, dp_cp=dense, edp=expert)
    names = writer_names([(u.name, u.meta, u.hi - u.lo) for u in family], coords)
    return [u for u in family if u.name in names]


def _name(key: str, chunk: Chunk) -> str:
    """A state-dict name for one chunk (a rank may hold several chunks of one tensor)."""
    return f"{key}@{','.join(map(str, chunk.offsets))}"


def save_state(chunks, optimizer, mesh, tracker, rank: int):
    """(values, pieces) keyed alike: the chunks this rank writes, as views of what it holds
    (a `Cast` where the stored dtype differs: made when DCP writes it), and each one's place
    in its logical tensor. Stage (copy) them before training continues (async save). fp32
    masters are stored where the weights compute in another dtype."""
    values, pieces = {}, {}
    with_master = optimizer.weight_dtype != torch.float32
    for family in holdings(chunks, optimizer, mesh):
        for unit in _written(family, mesh):
            for slot in unit.slots:
                if slot.kind == MASTER and not with_master:
                    continue
                for c in unit.chunks:
                    name, view = _name(f"{slot.kind}/{c.key}", c), c.view(slot.data, unit.lo)
                    values[name] = view if view.dtype == slot.dtype else Cast(view, slot.dtype)
                    pieces[name] = Piece(f"{slot.kind}/{c.key}", c.global_shape, c.offsets)
            if unit.writes_step():
                key = f"optim/step/{logical_name(unit.name, unit.meta)}"
                values[key], pieces[key] = unit.step.detach(), Piece(key, (), ())
    for gen, t in rng_states(tracker).items():
        key = f"rng/{rank}/{gen}"
        values[key], pieces[key] = t, Piece(key, tuple(t.shape), (0,) * t.dim())
    return values, pieces


@dataclasses.dataclass
class LoadTargets:
    """Where a load lands: `buffers` (views of the tensors this rank holds, and small host
    buffers for the step counts and RNG states) and `pieces` keyed alike, `parallel` (which
    this rank reads itself; the exchange of the rest). `begin()` before reading (zeros where
    nothing is stored: vocabulary padding), `finish()` after (step counts, masters)."""

    buffers: dict[str, torch.Tensor]
    pieces: dict[str, Piece]
    parallel: ParallelRead
    loaded: list[torch.Tensor]  # every tensor a read fills (zeroed first)
    steps: list[tuple[torch.Tensor, str]]  # (optimizer step tensor, its buffer's key)
    # (loaded view, view filled from it): the tied output-layer copy where its embedding is on
    # this rank too (zb-v's V placement puts both on pipeline rank 0), stored once
    aliases: list[tuple[torch.Tensor, torch.Tensor]]
    optimizer: object
    masters_loaded: bool

    @torch.no_grad()
    def begin(self) -> None:
        for t in self.loaded:
            t.zero_()

    @torch.no_grad()
    def finish(self) -> None:
        for step, key in self.steps:
            step.copy_(self.buffers[key])
        for src, dst in self.aliases:
            dst.copy_(src)
        commit = getattr(self.optimizer, "commit_loaded_states", None)
        if commit is not None:  # NVMe offload: the loaded states into the swap file
            commit()
        if not self.masters_loaded:  # masters that are copies start from the loaded weights
            self.optimizer.sync_masters_from_params()


def _kinds(optimizer, with_optimizer: bool, with_master: bool) -> set[str]:
    kinds = {MODEL}
    if with_optimizer:
        kinds |= {*state_kinds(optimizer), *([MASTER] if with_master else [])}
    return kinds


def load_targets(chunks, optimizer, mesh, with_optimizer: bool, with_master: bool = False):
    """This rank's `LoadTargets`: the model (and with_optimizer the optimizer state) it holds.
    `with_master`: the checkpoint holds fp32 master weights, read into the masters kept apart
    from the parameters (stage 3: into the fp32 shards, instead of the model weights)."""
    buffers, pieces, loaded, steps, aliases = {}, {}, [], [], []
    kinds = _kinds(optimizer, with_optimizer, with_master)
    families = []
    for family in holdings(chunks, optimizer, mesh):
        shared = []
        for unit in family:
            slots = [s for s in unit.slots if s.kind in kinds]
            if any(s.kind == MASTER for s in slots):  # the master replaces the weights it is
                slots = [s for s in slots if s.kind != MODEL]
            keys = []
            for slot in slots:
                loaded.append(slot.data)
                for c in unit.chunks:
                    name = _name(f"{slot.kind}/{c.key}", c)
                    if name in buffers:  # a tied copy beside its embedding: filled from it
                        aliases.append((buffers[name], c.view(slot.data, unit.lo)))
                        continue
                    buffers[name] = c.view(slot.data, unit.lo)
                    pieces[name] = Piece(f"{slot.kind}/{c.key}", c.global_shape, c.offsets)
                    keys.append(name)
            if slots and unit.step is not None:
                key = f"optim/step/{logical_name(unit.name, unit.meta)}"
                if key not in buffers:
                    buffers[key], pieces[key] = torch.zeros(()), Piece(key, (), ())
                steps.append((unit.step, key))
            if slots and keys:
                tensors = tuple(s.data for s in slots)
                shared.append(Shared(tuple(keys), tensors, unit.replicas, unit.meta.is_expert))
        families.append(shared)
    parallel = ParallelRead(buffers, families)
    masters = with_optimizer and with_master
    return LoadTargets(buffers, pieces, parallel, loaded, steps, aliases, optimizer, masters)
