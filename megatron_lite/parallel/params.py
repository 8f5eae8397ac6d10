"""Parameter metadata and layout-independent initialization.

Every parameter carries a `ParamMeta` saying how its full (logical) tensor is sharded. The full
tensor is defined blockwise along its sharded dim, each block drawn from a generator seeded by
(seed, init name, block), so a rank draws only the blocks its shard touches (time and memory
follow the shard) and the same seed gives the same model whatever the layout. Gradient finalization,
grad-norm clipping (parallel/data_parallel/finalize.py) and checkpoints read the same metadata.

A parameter without metadata (a plain `nn.Linear` or `nn.LayerNorm` mixed into a model) is
treated as replicated on every rank: `init_parameters` marks it so and runs its module's own
`reset_parameters()` under a generator seeded by (seed, module name), so every rank and layout
gets the same values; a module that cannot do that is refused with a message saying how to mark
the parameter.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch


@dataclass
class ParamMeta:
    full_shape: tuple[int, ...]  # logical shape before vocabulary padding and sharding
    tp_dim: int | None = None  # dim split across the TP group, None = replicated
    tp_rank: int = 0
    tp_size: int = 1
    segments: tuple[int, ...] | None = None  # sizes along tp_dim, each sharded separately
    padded: int | None = None  # size of tp_dim after vocabulary padding (zeros)
    init: str = "normal"  # normal | zeros | ones | module (its module's reset_parameters)
    std: float = 0.02
    sequence_parallel: bool = False  # replicated over TP but fed sequence shards: TP grad sum
    is_expert: bool = False  # sharded over EP; grads reduce over expert-data-parallel
    tied_copy: bool = False  # second copy of a tied weight (last pipeline stage)
    init_name: str | None = None  # seed key override (tied copies share the original's)


def unique_owner(meta: ParamMeta, mesh) -> bool:
    """Whether this rank holds the one copy of its shard that counts (parameter totals,
    checkpoint writes): dp·cp rank 0 (edp rank 0 for experts), TP rank 0 for TP-replicated
    params, never the tied last-stage copy."""
    if meta.tied_copy:
        return False
    if meta.is_expert:  # sharded over EP (meta.tp_*), replicated over TP and edp
        return mesh.edp.rank == 0 and mesh.tp.rank == 0
    return mesh.dp_cp.rank == 0 and (meta.tp_dim is not None or mesh.tp.rank == 0)


def set_meta(p: torch.nn.Parameter, **kw) -> torch.nn.Parameter:
    """Attach sharding/init metadata to `p` (ParamMeta's fields as keywords); returns `p`."""
    p.meta = ParamMeta(**kw)
    return p


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give `module`'s meta-device parameters uninitialized storage on `device` (nothing is
    drawn or copied), keeping each Parameter object and its attributes (`meta`, references
    held elsewhere stay valid)."""
    for p in module.parameters():
        if p.is_meta:
            attrs = dict(p.__dict__)
            new = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
            torch.utils.swap_tensors(p, new)
            p.__dict__.update(attrs)


def meta_of(p: torch.nn.Parameter) -> ParamMeta:
    """`p.meta`; a parameter without metadata is marked replicated (module-initialized)."""
    if not hasattr(p, "meta"):
        p.meta = ParamMeta(full_shape=tuple(p.shape), init="module")
    return p.meta


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


BLOCK_ELEMENTS = 1 << 16  # about this many values per generator block


def _block_length(shape: tuple[int, ...], dim: int) -> int:
    """Indices along `dim` per block: a function of the full shape alone."""
    per_index = max(1, math.prod(shape) // max(shape[dim], 1))
    return max(1, BLOCK_ELEMENTS // per_index)


def _draw(meta: ParamMeta, key: str, seed: int, dim: int, start: int, end: int) -> torch.Tensor:
    """Indices [start, end) along `dim` of the logical full tensor: block b of the full tensor
    (indices [b·B, (b+1)·B) along dim, everything else whole) comes from a generator seeded by
    (seed, key, b), so a rank draws only the blocks its shard touches."""
    full, n = meta.full_shape, meta.full_shape[dim]
    step, parts = _block_length(full, dim), []
    for b in range(start // step, -(-end // step)):
        lo, hi = b * step, min((b + 1) * step, n)
        shape = list(full)
        shape[dim] = hi - lo
        block = torch.randn(shape, generator=_generator(seed, f"{key}#{b}")) * meta.std
        a, e = max(start, lo), min(end, hi)
        parts.append(block.narrow(dim, a - lo, e - a))
    if not parts:
        shape = list(full)
        shape[dim] = 0
        return torch.empty(shape)
    return torch.cat(parts, dim=dim)


def full_tensor(meta: ParamMeta, name: str, seed: int) -> torch.Tensor:
    """The logical full tensor (fp32, CPU) for a parameter, identical on every layout."""
    if meta.init in ("zeros", "ones"):
        return (torch.zeros if meta.init == "zeros" else torch.ones)(meta.full_shape)
    dim = meta.tp_dim or 0
    return _draw(meta, meta.init_name or name, seed, dim, 0, meta.full_shape[dim])


def init_shard(meta: ParamMeta, name: str, seed: int) -> torch.Tensor:
    """This rank's shard of `full_tensor(meta, name, seed)`, drawing only the blocks it needs:
    time and memory follow the shard, not the whole parameter."""
    dim = meta.tp_dim if meta.tp_dim is not None else 0
    n = meta.full_shape[dim]
    size = meta.padded if meta.padded is not None else n
    segments = meta.segments or (size,)
    tp, r = (meta.tp_size, meta.tp_rank) if meta.tp_dim is not None else (1, 0)
    parts, offset = [], 0
    for seg in segments:
        lo, hi = offset + r * seg // tp, offset + (r + 1) * seg // tp  # this rank's chunk
        real = max(lo, min(hi, n))  # rows past n are vocabulary padding (zeros)
        if meta.init in ("zeros", "ones"):
            shape = list(meta.full_shape)
            shape[dim] = real - lo
            fill = torch.zeros if meta.init == "zeros" else torch.ones
            parts.append(fill(shape))
        else:
            parts.append(_draw(meta, meta.init_name or name, seed, dim, lo, real))
        if hi > real:
            shape = list(meta.full_shape)
            shape[dim] = hi - real
            parts.append(torch.zeros(shape))
        offset += seg
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def shard(full: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """This rank's piece of `full`: pad `tp_dim` to `padded`, then take chunk tp_rank of each
    segment along it."""
    if meta.tp_dim is None:
        return full
    dim = meta.tp_dim
    if meta.padded is not None and meta.padded > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = meta.padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    segments = meta.segments or (full.shape[dim],)
    pieces = [
        seg.chunk(meta.tp_size, dim=dim)[meta.tp_rank]
        for seg in full.split(list(segments), dim=dim)
    ]
    return torch.cat(pieces, dim=dim)


@torch.no_grad()
def init_parameters(module: torch.nn.Module, seed: int) -> None:
    """Fill every parameter layout-independently (see module docstring): unmarked parameters
    through their module's reset_parameters() under a seeded generator, then every marked one
    from its seeded full tensor."""
    for mod_name, mod in module.named_modules():
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if not hasattr(p, "meta")]
        if own:
            _reset_replicated(mod_name, mod, [n for n, _ in own], seed)
            for _, p in own:
                meta_of(p)
    for name, p in module.named_parameters():
        if p.meta.init != "module":
            p.copy_(init_shard(p.meta, name, seed))


def _reset_replicated(mod_name: str, mod: torch.nn.Module, names: list[str], seed: int) -> None:
    reset = getattr(mod, "reset_parameters", None)
    if reset is None:
        where = f"{mod_name}.{names[0]}" if mod_name else names[0]
        raise ValueError(
            f"parameter {where!r} ({type(mod).__name__}) has no sharding metadata and its module "
            "has no reset_parameters() to initialize it the same on every rank. Fix: mark it "
            "with megatron_lite.parallel.params.set_meta(param, full_shape=..., init='normal' | "
            "'zeros' | 'ones', std=...), or give the module a reset_parameters()"
        )
    devices = [p.device for p in mod.parameters(recurse=False) if p.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_generator(seed, mod_name or "<root>").initial_seed())
        reset()


def scaled_std(std: float, num_layers: int) -> float:
    """Megatron's init for the output projections of residual branches."""
    return std / math.sqrt(2.0 * num_layers)
