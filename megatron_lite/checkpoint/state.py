"""What a checkpoint holds, and how this rank's tensors map onto it (layout independence).

Every parameter is stored as LOGICAL tensors, whatever the layout that wrote it:

    model/<name>[/<segment>]                  the parameter (vocabulary padding dropped)
    optim/exp_avg/<same>, optim/exp_avg_sq/<same>   AdamW moments, cut like the parameter
    optim/step/<name>                         AdamW step count (0-d)
    rng/<rank>/<generator>                    this rank's RNG states (same layout only)

A parameter sharded along `tp_dim` (over TP, or over EP for experts) is one logical tensor of
`meta.full_shape`; a fused one (qkv [q, k, v], fc1 [gate, up]) is one logical tensor per
segment (`.../linear_qkv.weight/q`), because each segment is split over TP separately, so every
rank's piece of a segment is one contiguous block at a known offset. A rank describes its
pieces by (offsets, sizes) in DCP's chunk metadata; DCP's resharding reads whatever overlap
another layout's pieces have with the stored ones. Exactly one rank writes each piece, one of
its replicas chosen by `writer_names` so the writing is spread over them, and never the tied
output-layer copy (it loads the embedding's tensors).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
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

from megatron_lite.checkpoint.exchange import ParamKeys
from megatron_lite.parallel.params import ParamMeta

SEGMENT_NAMES = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Piece:
    """This rank's block of the logical tensor `key`: the local tensor's rows
    [start, start + length) along `dim` (the whole local tensor when dim is None) sit at
    `offsets` of a tensor of `global_shape`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int = 0

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dim is None else t.narrow(self.dim, self.start, self.length)


def _at(shape: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    return tuple(value if i == dim else s for i, s in enumerate(shape))


def logical_name(name: str, meta: ParamMeta) -> str:
    """Checkpoint name of a parameter: the tied output-layer copy is the embedding."""
    return meta.init_name if meta.tied_copy and meta.init_name else name


def param_pieces(name: str, meta: ParamMeta) -> list[Piece]:
    """The logical blocks this rank's shard of parameter `name` consists of."""
    base, full = logical_name(name, meta), tuple(meta.full_shape)
    zeros, d = (0,) * len(full), meta.tp_dim
    if d is None:
        return [Piece(base, full, zeros)]
    tp, r = meta.tp_size, meta.tp_rank
    if meta.padded is not None:  # rows past the real vocabulary are padding: not stored
        per = meta.padded // tp
        n = max(0, min(per, full[d] - r * per))
        return [Piece(base, full, _at(zeros, d, r * per), d, 0, n)] if n else []
    segments = meta.segments or (full[d],)
    if len(segments) == 1:
        n = full[d] // tp
        return [Piece(base, full, _at(zeros, d, r * n), d, 0, n)]
    module = name.split(".")[-2]
    names = SEGMENT_NAMES.get(module, ())
    if len(names) != len(segments):
        names = tuple(f"seg{i}" for i in range(len(segments)))
    pieces, start = [], 0
    for seg_name, size in zip(names, segments, strict=True):
        n = size // tp
        shape = _at(full, d, size)
        pieces.append(Piece(f"{base}/{seg_name}", shape, _at(zeros, d, r * n), d, start, n))
        start += n
    return pieces


def writer_names(params: list[tuple[str, ParamMeta, int]], mesh) -> set[str]:
    """Which of this stage's parameters (name, meta, elements) this rank writes, so that every
    replica group (dp·cp, or expert-data-parallel, × TP for TP-replicated parameters) shares
    the writing about evenly (Megatron's fully parallel save): parameters are dealt, largest
    first, to the least-loaded replica. Every rank of a stage computes the same table (their
    parameters have the same names and local sizes), so each piece has one writer."""
    loads: dict[tuple, int] = {}
    mine = set()
    tp, my_t = mesh.tp.size, mesh.tp.rank
    for name, meta, numel in sorted(params, key=lambda item: (-item[2], item[0])):
        if meta.tied_copy:  # the embedding's copy on the last stage: the first stage writes it
            continue
        group = mesh.edp if meta.is_expert else mesh.dp_cp
        kind = "expert" if meta.is_expert else "dense"
        if meta.tp_dim is None or meta.is_expert:  # one copy on every (replica, TP rank)
            slots = [(kind, d, t) for d in range(group.size) for t in range(tp)]
            best = min(slots, key=lambda s: (loads.get(s, 0), s))
            loads[best] = loads.get(best, 0) + numel
            mine.update([name] if best == (kind, group.rank, my_t) else [])
            continue
        for t in range(tp):  # each TP rank's shard has its own replicas
            best = min(
                ((kind, d, t) for d in range(group.size)), key=lambda s: (loads.get(s, 0), s)
            )
            loads[best] = loads.get(best, 0) + numel
            if t == my_t and best[1] == group.rank:
                mine.add(name)
    return mine


def named_parameters(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """Every parameter of this rank's chunks; checkpoints hold parameters only, so a persistent
    buffer (state that would silently not be saved) is an error."""
    out = []
    for c in chunks:
        params = list(c.named_parameters())
        buffers = set(c.state_dict()) - {n for n, _ in params}
        if buffers:
            raise NotImplementedError(
                f"persistent buffers {sorted(buffers)[:3]} are not checkpointed: register them "
                "with persistent=False or add them to checkpoint/state.py"
            )
        out += params
    return out


def rng_states(tracker) -> dict[str, torch.Tensor]:
    """This rank's generators: the default CPU (and CUDA) ones and the TP tracker's."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    for name, (cpu, cuda) in tracker.states.items():
        out[f"tracker/{name}/cpu"] = cpu
        if cuda is not None:
            out[f"tracker/{name}/cuda"] = cuda
    return out


def set_rng_states(tracker, states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available() and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    for name, (_, cuda_now) in tracker.states.items():
        # a CUDA state is restored only where there is CUDA; a checkpoint without one (saved
        # on CPU) keeps the freshly seeded state, so fork() still switches the CUDA generator
        cuda = states.get(f"tracker/{name}/cuda") if torch.cuda.is_available() else None
        tracker.states[name] = (
            states[f"tracker/{name}/cpu"],
            cuda if cuda is not None else cuda_now,
        )


def has_master_copies(chunks) -> bool:
    """Whether the optimizer keeps fp32 master weights apart from the (bf16) parameters."""
    return any(p.dtype != torch.float32 for c in chunks for p in c.parameters())


def whole_weights(optimizer, gather: bool = True) -> dict[int, torch.Tensor]:
    """id(param) -> the whole local tensor of each parameter, from an optimizer whose parameters
    are themselves sharded (ZeRO-3: `full_weights`, collective); empty when they are whole.
    gather=False: tensors of those shapes to load into (nothing gathered)."""
    return optimizer.full_weights(gather=gather)  # DataParallelOptimizer: {} in stages 0-2


def save_state(chunks, optimizer, mesh, tracker, rank: int):
    """(tensors, pieces) keyed alike: what this rank writes. Tensors are views; stage (copy)
    them before training continues. The optimizer's state arrives as whole (logical) tensors
    per parameter whatever the ZeRO stage (`full_states`, collective), plus the fp32 master
    weights when they are kept apart from bf16 parameters."""
    tensors, pieces = {}, {}
    optimizer_states = optimizer.full_states(with_master=has_master_copies(chunks))
    weights = whole_weights(optimizer)

    def add(key: str, t: torch.Tensor, piece: Piece) -> None:
        tensors[key], pieces[key] = t.detach(), piece

    named = named_parameters(chunks)
    to_write = writer_names([(n, p.meta, p.numel()) for n, p in named], mesh)
    for name, p in named:
        if name not in to_write:
            continue
        state = optimizer_states.get(id(p), {})
        mine = param_pieces(name, p.meta)
        for piece in mine:
            add(f"model/{piece.key}", piece.local(weights.get(id(p), p)), piece)
            for k in (*MOMENTS, "master"):
                if k in state:
                    add(f"optim/{k}/{piece.key}", piece.local(state[k]), piece)
        if "step" in state and any(not any(pc.offsets) for pc in mine):
            key = logical_name(name, p.meta)
            add(f"optim/step/{key}", state["step"], Piece(key, (), ()))
    for gen, t in rng_states(tracker).items():
        key = f"rng/{rank}/{gen}"
        add(key, t, Piece(key, tuple(t.shape), (0,) * t.dim()))
    return tensors, pieces


def load_targets(chunks, optimizer, with_optimizer: bool, with_master: bool = False):
    """Buffers to read this rank's pieces into, keyed by checkpoint key, their pieces,
    `apply()` that copies them into the parameters and hands the optimizer its state (zeros in
    vocabulary padding), and the buffers' keys per parameter (for the fully parallel read).
    `with_master`: the checkpoint holds fp32 master weights (else masters that are copies
    start from the loaded parameters)."""
    buffers, pieces, plan, per_param = {}, {}, [], []
    optim_kinds = (*MOMENTS, "master") if with_master else MOMENTS
    weights = whole_weights(optimizer, gather=False)  # destinations: every element loaded
    for name, p in named_parameters(chunks):
        w = weights.get(id(p), p)  # what the checkpoint holds: the whole local tensor
        entries, new_keys = [], []
        for piece in param_pieces(name, p.meta):
            kinds = ("model", *(f"optim/{k}" for k in optim_kinds if with_optimizer))
            for kind in kinds:
                key = f"{kind}/{piece.key}"
                if key not in buffers:
                    dtype = w.dtype if kind == "model" else torch.float32
                    buffers[key] = torch.empty(piece.local(w).shape, dtype=dtype, device="cpu")
                    pieces[key] = piece
                    new_keys.append(key)
                entries.append((kind, piece, key))
        step_key = None
        if with_optimizer:
            step_key = f"optim/step/{logical_name(name, p.meta)}"
            if step_key not in buffers:
                buffers[step_key] = torch.zeros((), dtype=torch.float32)
                pieces[step_key] = Piece(step_key, (), ())
                new_keys.append(step_key)
        plan.append((p, w, entries, step_key))
        if new_keys:
            per_param.append(ParamKeys(tuple(new_keys), bool(p.meta.is_expert)))

    @torch.no_grad()
    def apply() -> None:
        states = {}
        for p, w, entries, step_key in plan:
            dest = {"model": w.data}
            if with_optimizer:
                # on the host: the optimizer moves each shard to the device (load_full_states)
                state = {k: torch.zeros(w.shape, dtype=torch.float32) for k in optim_kinds}
                dest.update({f"optim/{k}": t for k, t in state.items()})
                state["step"] = buffers[step_key].clone()
                states[id(p)] = state
            if p.meta.padded is not None:
                w.data.zero_()
            for kind, piece, key in entries:
                piece.local(dest[kind]).copy_(buffers[key])
        if weights:
            optimizer.load_full_weights(weights)
        if with_optimizer:
            optimizer.load_full_states(states)
        else:
            optimizer.sync_masters_from_params()

    return buffers, pieces, apply, per_param


def add_rng_targets(buffers: dict, pieces: dict, stored: dict, rank: int) -> None:
    """Add load targets for this rank's stored RNG states (`stored`: DCP's
    state_dict_metadata); same layout only, as their number and meaning depend on it."""
    prefix = f"rng/{rank}/"
    for key, t in stored.items():
        if key.startswith(prefix):
            buffers[key] = torch.empty(t.size, dtype=t.properties.dtype)
            pieces[key] = Piece(key, tuple(t.size), (0,) * len(t.size))


def loaded_rng_states(buffers: dict, rank: int) -> dict[str, torch.Tensor]:
    """{generator: state} of this rank's RNG states once `buffers` are loaded."""
    prefix = f"rng/{rank}/"
    return {k[len(prefix) :]: v for k, v in buffers.items() if k.startswith(prefix)}


class ShardSavePlanner(DefaultSavePlanner):
    """Writes each tensor as a chunk of its logical tensor at the piece's offsets."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, t in self.state_dict.items():
            piece = self.pieces[key]
            offsets = torch.Size(piece.offsets)
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=t.size())
            data = TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(t),
                size=torch.Size(piece.global_shape),
            )
            items.append(
                WriteItem(MetadataIndex(key, offsets), WriteItemType.SHARD, tensor_data=data)
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn]


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads the overlap of this rank's pieces with whatever chunks were saved."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, t in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[key]
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(self.pieces[key].offsets), sizes=t.size()
            )
            items += create_read_items_for_chunk_list(key, stored, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]
