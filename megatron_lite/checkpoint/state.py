"""What a checkpoint holds, and how this rank's tensors map onto it (layout independence).

Every parameter is stored as LOGICAL tensors, whatever the layout that wrote it:

    model/<name>[/<segment>]                  the parameter (vocabulary padding dropped)
    optim/<state>/<same>                      the optimizer's states, cut like the parameter
                                              (its OptimizerSpec's state names; AdamW:
                                              optim/exp_avg/..., optim/exp_avg_sq/...)
    optim/master/<same>                       fp32 masters, where the weights are not fp32
    optim/step/<name>                         the optimizer's step count (0-d)
    rng/<rank>/<generator>                    this rank's RNG states (same layout only)

A parameter sharded along `tp_dim` (over TP, or over EP for experts) is one logical tensor of
`meta.full_shape`; a fused one (qkv [q, k, v], fc1 [gate, up]) is one logical tensor per
segment (`.../linear_qkv.weight/q`), because each segment is split over TP separately, so every
rank's piece of a segment is one contiguous block at a known offset. A rank writes the part
of its pieces it holds (the whole piece, or its ZeRO / FSDP2 shard of it) as chunks at their
(offsets, sizes) in DCP's chunk metadata (chunks.py, holdings.py); DCP's resharding reads
whatever overlap another layout's chunks have with the stored ones. Exactly one rank writes
each chunk, one of its replicas chosen by `writer_names` so the writing is spread over them,
and never the tied output-layer copy (it loads the embedding's tensors).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_lite.parallel.params import ParamMeta

SEGMENT_NAMES = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}


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
