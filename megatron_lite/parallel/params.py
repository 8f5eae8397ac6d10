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

A parameter that FSDP2 (ZeRO-3) has sharded further along dim 0 is a `DTensor`: each rank draws
only the rows of its TP shard that it holds (`fsdp_rows`), so a model built on the meta device
and sharded there never holds more than its shards.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_lite.parallel import fake


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
    # a stack of matrices (experts [E, rows, cols]): the row sizes of the separate matrices
    # fused in each (gate, up), for an optimizer that orthogonalizes each alone (None: one)
    matrix_rows: tuple[int, ...] | None = None


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


def _draw(
    meta: ParamMeta,
    key: str,
    seed: int,
    dim: int,
    start: int,
    end: int,
    rows: tuple[int, int] | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Indices [start, end) along `dim` of the logical full tensor into `out` (any dtype):
    block b of the full tensor (indices [b·B, (b+1)·B) along dim, everything else whole) comes
    from a generator seeded by (seed, key, b), so a rank draws only the blocks its shard
    touches, and each is copied into `out` as it is drawn (the extra memory is one block, not
    the range). `rows` (dim != 0): keep only rows [a, b) along dim 0 of each block (an FSDP2
    shard of a tensor sharded along another dim holds one block at a time)."""
    full, n = meta.full_shape, meta.full_shape[dim]
    step = _block_length(full, dim)
    if fake.active() and end > start:
        return _draw_nothing(meta, dim, start, end, step, out)
    for b in range(start // step, -(-end // step)):
        lo, hi = b * step, min((b + 1) * step, n)
        shape = list(full)
        shape[dim] = hi - lo
        block = torch.randn(shape, generator=_generator(seed, f"{key}#{b}")) * meta.std
        if rows is not None:
            block = block[rows[0] : rows[1]]
        a, e = max(start, lo), min(end, hi)
        out.narrow(dim, a - start, e - a).copy_(block.narrow(dim, a - lo, e - a))
        del block  # before the next draw: one block's draw and its scaled copy at most
    return out


def _draw_nothing(meta: ParamMeta, dim: int, start: int, end: int, step: int, out):
    """_draw's allocations without its ops per block, for a dry run (fake tensors, nothing to
    draw): one block's raw draw and its scaled copy for a moment."""
    b0, b1 = start // step, -(-end // step)
    extent = min(b1 * step, meta.full_shape[dim]) - b0 * step
    raw = torch.empty(_shape(meta, dim, min(step, extent), None))
    scaled = torch.empty(_shape(meta, dim, min(step, extent), None))
    del raw, scaled
    return out


def _shape(meta: ParamMeta, dim: int, length: int, rows: tuple[int, int] | None) -> list[int]:
    """The full shape with `length` indices along `dim` (and rows[1] - rows[0] along 0)."""
    shape = list(meta.full_shape)
    shape[dim] = length
    if rows is not None:
        shape[0] = rows[1] - rows[0]
    return shape


def full_tensor(meta: ParamMeta, name: str, seed: int) -> torch.Tensor:
    """The logical full tensor (fp32, CPU) for a parameter, identical on every layout."""
    if meta.init in ("zeros", "ones"):
        return (torch.zeros if meta.init == "zeros" else torch.ones)(meta.full_shape)
    dim = meta.tp_dim or 0
    out = torch.empty(meta.full_shape)
    return _draw(meta, meta.init_name or name, seed, dim, 0, meta.full_shape[dim], None, out)


def _tp_pieces(meta: ParamMeta) -> list[tuple[int, int, bool]]:
    """This TP shard along its dim as pieces (lo, hi, drawn) of the padded full tensor, in
    order: drawn indices of the logical tensor, or vocabulary padding (zeros) past it."""
    dim = meta.tp_dim if meta.tp_dim is not None else 0
    n = meta.full_shape[dim]
    size = meta.padded if meta.padded is not None else n
    tp, r = (meta.tp_size, meta.tp_rank) if meta.tp_dim is not None else (1, 0)
    pieces, offset = [], 0
    for seg in meta.segments or (size,):
        lo, hi = offset + r * seg // tp, offset + (r + 1) * seg // tp  # this rank's chunk
        real = max(lo, min(hi, n))  # rows past n are vocabulary padding (zeros)
        pieces += [(lo, real, True), (real, hi, False)]
        offset += seg
    return [piece for piece in pieces if piece[1] > piece[0]] or [(0, 0, True)]


def _rows_of(pieces: list[tuple[int, int, bool]], start: int, end: int):
    """The pieces that rows [start, end) of their concatenation (along dim 0) cover."""
    out, at = [], 0
    for lo, hi, drawn in pieces:
        a, b = max(start, at), min(end, at + hi - lo)
        if b > a:
            out.append((lo + a - at, lo + b - at, drawn))
        at += hi - lo
    return out or [(0, 0, True)]


def init_shard(
    meta: ParamMeta,
    name: str,
    seed: int,
    rows: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's shard of `full_tensor(meta, name, seed)`, drawing only the blocks it needs:
    time and memory follow the shard, not the whole parameter. `rows`: only rows [a, b) along
    dim 0 of that shard (what FSDP2 keeps of it on this rank, see `fsdp_rows`). Written block
    by block as drawn into `out` (the shard's shape, any dtype; default a new fp32 tensor) and
    returned, so the draw's extra memory is one generator block."""
    dim = meta.tp_dim if meta.tp_dim is not None else 0
    pieces = _tp_pieces(meta)
    if rows is not None and dim == 0:  # the rows are pieces of the TP shard's own dim
        pieces, rows = _rows_of(pieces, *rows), None
    if out is None:
        out = torch.empty(_shape(meta, dim, sum(hi - lo for lo, hi, _ in pieces), rows))
    at = 0
    for lo, hi, drawn in pieces:
        dest = out.narrow(dim, at, hi - lo)
        if not drawn or meta.init == "zeros":
            dest.zero_()
        elif meta.init == "ones":
            dest.fill_(1)
        else:
            _draw(meta, meta.init_name or name, seed, dim, lo, hi, rows, dest)
        at += hi - lo
    return out


def fsdp_rows(p: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, end) along dim 0 of its (TP-local) tensor that this rank holds of a
    DTensor parameter sharded along dim 0, as FSDP2 cuts it: torch.chunk over each Shard(0)
    mesh dim, so ceil(n/N) rows per rank and trailing ranks short or empty. None for a plain
    tensor (this rank holds all of it)."""
    if not isinstance(p, DTensor):
        return None
    start, n = 0, p.shape[0]
    for mesh_dim, placement in enumerate(p.placements):
        if type(placement) is Shard and placement.dim == 0:
            size, r = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
            per = -(-n // size)
            lo, hi = min(r * per, n), min((r + 1) * per, n)
            start, n = start + lo, hi - lo
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} is placed {p.placements}: initialization "
                "draws shards along dim 0 only (FSDP2's default Shard(0)). Fix: shard along dim "
                "0 or initialize before sharding"
            )
    local = p.to_local().shape[0] if p.dim() else 0
    if local != n:
        raise RuntimeError(
            f"parameter of shape {tuple(p.shape)}: this rank holds {local} rows, but FSDP2's "
            f"torch.chunk layout gives {n} (rows {start}..{start + n}); the sharded layout of "
            f"this torch ({torch.__version__}) differs from what fsdp_rows assumes"
        )
    return start, start + n


def fsdp_replicas(p: torch.Tensor):
    """The process group over which a DTensor parameter's shard is replicated (HSDP's
    replicate mesh dim), or None: sharded only, or a plain tensor."""
    if not isinstance(p, DTensor):
        return None
    dims = [i for i, placement in enumerate(p.placements) if isinstance(placement, Replicate)]
    if not dims:
        return None
    if len(dims) > 1:
        raise ValueError(f"parameter placed {p.placements}: one replicate mesh dim expected")
    return p.device_mesh.get_group(dims[0])


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
    from its seeded full tensor. A DTensor (FSDP2-sharded) parameter gets its local rows."""
    for mod_name, mod in module.named_modules():
        # unmarked, or marked by a reader of the metadata (a data-parallel wrapper) before
        own = [n for n, p in mod.named_parameters(recurse=False) if meta_of(p).init == "module"]
        if own:
            _reset_replicated(mod_name, mod, own, seed)
    for name, p in module.named_parameters():
        if p.meta.init != "module":
            rows = fsdp_rows(p)
            local = p.to_local() if rows is not None else p
            init_shard(p.meta, name, seed, rows, out=local)


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
    # reset_parameters draws whole tensors: a sharded (DTensor) parameter lends it a whole
    # one for the moment (this module's replicated parameters only), then keeps its rows
    sharded = {n: getattr(mod, n) for n in names if isinstance(getattr(mod, n), DTensor)}
    for n, p in sharded.items():
        whole = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        setattr(mod, n, torch.nn.Parameter(whole, p.requires_grad))
    devices = [p.device for p in mod.parameters(recurse=False) if p.device.type == "cuda"]
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_generator(seed, mod_name or "<root>").initial_seed())
            reset()
    finally:
        drawn = {n: getattr(mod, n) for n in sharded}
        for n, p in sharded.items():
            setattr(mod, n, p)
    for n, p in sharded.items():
        start, end = fsdp_rows(p)
        p.to_local().copy_(drawn[n][start:end])


def scaled_std(std: float, num_layers: int) -> float:
    """Megatron's init for the output projections of residual branches."""
    return std / math.sqrt(2.0 * num_layers)
