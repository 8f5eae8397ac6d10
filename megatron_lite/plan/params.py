"""Parameter counts of one rank, as the model code lays them out: per layer, per model chunk
(in registration order, what the gradient buffers cut into buckets), per pipeline rank, and
the units FSDP2 gathers (ZeRO-3). On one TP/EP rank. Every figure is read off the real modules
built at the layout's local shapes (plan/modules.py)."""

from __future__ import annotations

from typing import NamedTuple

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel import arguments
from megatron_lite.parallel.data_parallel.optimizer_spec import OptimizerSpec, group_index
from megatron_lite.parallel.params import meta_of
from megatron_lite.pipeline.schedules import schedule_placement, virtual_stage
from megatron_lite.plan import modules
from megatron_lite.resolve import moe_layer_pattern, stage_layers

Param = tuple[int, bool]  # (elements, is_expert)


def layer_param_list(cfg: Config, moe: bool) -> list[Param]:
    """One transformer layer's parameters (an MoE layer's when `moe`) in registration order,
    as `TransformerLayer` builds them at the layout's local shapes."""
    return list(modules.layer_params(cfg, moe).params)


def layer_linear_weights(cfg: Config, moe: bool) -> int:
    """Elements of one layer's parallel-linear weights, those whose gradient GEMM a split
    backward queues for W (the modules with a `wgrad_queue`, parallel/linear_async.py)."""
    return modules.layer_params(cfg, moe).linear_weights


def layer_params(cfg: Config, moe: bool) -> tuple[int, int]:
    """(dense, expert) parameters of one layer on one TP/EP rank."""
    params = layer_param_list(cfg, moe)
    return sum(n for n, e in params if not e), sum(n for n, e in params if e)


def placement(cfg: Config) -> str:
    """Where the pipeline schedule's record puts the virtual stages ("loop" or "v")."""
    return schedule_placement(cfg.parallel.pipeline_schedule, cfg.parallel.vpp)


def rank_layers(cfg: Config, pp_rank: int) -> list[tuple[int, int]]:
    """(first layer index, layer count) of each model chunk on pipeline rank `pp_rank`."""
    return list(
        modules.per_config(cfg, ("rank_layers", pp_rank), lambda: _rank_layers(cfg, pp_rank))
    )


def _rank_layers(cfg: Config, pp_rank: int) -> tuple[tuple[int, int], ...]:
    counts, p, place = stage_layers(cfg.model, cfg.parallel), cfg.parallel, placement(cfg)
    stages = (virtual_stage(pp_rank, c, p.pp, place) for c in range(p.vpp))
    return tuple((sum(counts[:s]), counts[s]) for s in stages)


def chunk_moe(cfg: Config, pp_rank: int, chunk: int) -> list[bool]:
    """Whether each layer of the model chunk is an MoE layer."""
    return list(_chunk_moe(cfg, pp_rank, chunk))


def _chunk_moe(cfg: Config, pp_rank: int, chunk: int) -> tuple[bool, ...]:
    def answer():
        first, count = rank_layers(cfg, pp_rank)[chunk]
        return tuple(moe_layer_pattern(cfg.model)[first : first + count])

    return modules.per_config(cfg, ("chunk_moe", pp_rank, chunk), answer)


def head_params(cfg: Config, pp_rank: int, chunk: int) -> tuple[list[Param], list[Param]]:
    """(before the layers, after them) of a chunk: what `ModelChunk` registers besides its
    layers (the embedding on virtual stage 0, the final norm and output layer on the last)."""
    own = _chunk_own(cfg, pp_rank, chunk)
    return list(own.before), list(own.after)


def _chunk_own(cfg: Config, pp_rank: int, chunk: int) -> modules.ChunkParams:
    def answer():
        p = cfg.parallel
        stage, last = virtual_stage(pp_rank, chunk, p.pp, placement(cfg)), p.pp * p.vpp - 1
        return modules.chunk_params(cfg, stage == 0, stage == last)

    return modules.per_config(cfg, ("chunk_own", pp_rank, chunk), answer)


def chunk_param_list(cfg: Config, pp_rank: int, chunk: int) -> list[Param]:
    """Every parameter of a model chunk in registration order (models/chunk.py)."""
    return list(_chunk_param_list(cfg, pp_rank, chunk))


def _chunk_param_list(cfg: Config, pp_rank: int, chunk: int) -> tuple[Param, ...]:
    def answer():
        own, moe = _chunk_own(cfg, pp_rank, chunk), _chunk_moe(cfg, pp_rank, chunk)
        lists = {e: modules.layer_params(cfg, e).params for e in set(moe)}
        return own.before + tuple(q for e in moe for q in lists[e]) + own.after

    return modules.per_config(cfg, ("chunk_param_list", pp_rank, chunk), answer)


def last_embedding_grad(cfg: Config, pp_rank: int, chunk: int) -> int | None:
    """Index into chunk_param_list of the parameter before the layers whose gradient the
    embedding's backward makes last (plan/modules.py measures it); None without an
    embedding."""
    return _chunk_own(cfg, pp_rank, chunk).last_grad


def rank_params(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameters this pipeline rank holds on one TP/EP rank."""

    def answer():  # a chunk's own parameters and each of its layers' (per kind, summed once)
        chunks = [(_chunk_own(cfg, pp_rank, c), _chunk_moe(cfg, pp_rank, c))
                  for c in range(cfg.parallel.vpp)]  # fmt: skip
        kinds = {e for _, moe in chunks for e in moe}
        sums = {e: _split(modules.layer_params(cfg, e).params) for e in kinds}
        dense = expert = 0
        for own, moe in chunks:
            d, x = _split(own.before + own.after)
            dense, expert = dense + d, expert + x
            for e in kinds:  # (integers: the order of the sum does not matter)
                n = moe.count(e)
                dense, expert = dense + sums[e][0] * n, expert + sums[e][1] * n
        return dense, expert

    return modules.per_config(cfg, ("rank_params", pp_rank), answer)


def _split(params) -> tuple[int, int]:
    """(dense, expert) elements of `params`."""
    return sum(n for n, e in params if not e), sum(n for n, e in params if e)


def largest_params(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) elements of the largest parameter this pipeline rank holds on one TP/EP
    rank (a gradient bucket holds fewer than bucket_size + it)."""
    params = [q for c in range(cfg.parallel.vpp) for q in chunk_param_list(cfg, pp_rank, c)]
    dense = [n for n, e in params if not e]
    expert = [n for n, e in params if e]
    return max(dense, default=0), max(expert, default=0)


def buckets(cfg: Config, pp_rank: int, chunk: int, expert: bool, shard: int) -> list[tuple]:
    """(elements, parameters) of each gradient bucket of the chunk's dense (or expert) buffer,
    in backward order, as GradBuffer._layout cuts them: the parameters reversed, a bucket
    closed once it reaches bucket_size (tied embeddings under pp > 1 alone), padded to a
    multiple of `shard`. A parameter the optimizer steps whole (whole_matrix.py: its own
    buffer, no sharded buckets) counts as 0 elements of the bucket it arrives in."""
    key = ("buckets", pp_rank, chunk, expert, shard)
    return list(modules.per_config(cfg, key, lambda: _buckets(cfg, pp_rank, chunk, expert, shard)))


def _buckets(cfg: Config, pp_rank: int, chunk: int, expert: bool, shard: int) -> tuple:
    m, p = cfg.model, cfg.parallel
    own = _chunk_own(cfg, pp_rank, chunk)
    before, params = own.before, _chunk_param_list(cfg, pp_rank, chunk)
    layers = len(params) - len(before) - len(own.after)
    alone = set()
    if m.tie_embeddings and p.pp > 1:  # the tied embedding weights (ddp.py: own buckets)
        alone = {i if i < len(before) else i + layers for i in own.tied}
    whole = [r.whole for r in optimizer_rows(cfg, pp_rank, chunk)]
    out, size, count = [], 0, 0
    for i in reversed(range(len(params))):
        n, is_expert = params[i]
        if is_expert != expert:
            continue
        n = 0 if whole and whole[i] else n  # in a gradient buffer of its own, reduced whole
        if i in alone and size:
            out.append((-(-size // shard) * shard, count))
            size = count = 0
        size, count = size + n, count + 1
        if i in alone or size >= p.ddp_bucket_size:
            out.append((-(-size // shard) * shard, count))
            size = count = 0
    if size:
        out.append((-(-size // shard) * shard, count))
    return tuple(out)


def fsdp_units(cfg: Config, pp_rank: int, chunk: int) -> tuple[int, list[int]]:
    """ZeRO-3 (parallel/data_parallel/fsdp.py): (the chunk root's parameters: embedding, final
    norm, output layer, the MTP modules' dense ones; each layer's, its experts included, then
    the experts outside the layers, an MoE MTP layer's, as one more unit), the units FSDP2
    gathers."""

    def answer():
        own, moe = _chunk_own(cfg, pp_rank, chunk), _chunk_moe(cfg, pp_rank, chunk)
        size = {e: sum(n for n, _ in modules.layer_params(cfg, e).params) for e in set(moe)}
        dense, expert = _split(own.before + own.after)
        return dense, tuple(size[e] for e in moe) + ((expert,) if expert else ())

    root, layers = modules.per_config(cfg, ("fsdp_units", pp_rank, chunk), answer)
    return root, list(layers)


def buffer_bytes(cfg: Config, pp_rank: int) -> int:
    """Bytes of the buffers of this pipeline rank's chunks (RoPE tables, the vocabulary
    padding mask, any layer's), as the modules hold them."""

    def answer():
        out = 0
        for c in range(cfg.parallel.vpp):
            out += _chunk_own(cfg, pp_rank, c).buffer_bytes
            moe = _chunk_moe(cfg, pp_rank, c)
            out += sum(modules.layer_params(cfg, e).buffer_bytes * moe.count(e) for e in set(moe))
        return out

    return modules.per_config(cfg, ("buffer_bytes", pp_rank), answer)


class OptimizerRow(NamedTuple):
    """How train.optimizer steps one parameter (its spec's groups rule, optimizer_spec.py)."""

    elements: int
    is_expert: bool
    whole: bool  # its group needs whole matrices (whole_matrix.py)
    state_bytes: int  # its group's optimizer-state bytes per element
    cost: float  # the spec's cost of its whole-matrix update (elements without one)
    tp_sharded: bool = False  # a whole-matrix update gathers its TP shards (not an expert's)


def optimizer_settings(cfg: Config) -> tuple[OptimizerSpec, dict]:
    """(spec, hyperparameters) of the config's optimizer, as the trainer builds them."""
    from megatron_lite.training.optimizer import optimizer_arguments

    return arguments.optimizer_settings(optimizer_arguments(cfg.train))


def optimizer_rows(cfg: Config, pp_rank: int, chunk: int) -> tuple[OptimizerRow, ...]:
    """An OptimizerRow per parameter of the model chunk, in registration order
    (chunk_param_list's); () for an elementwise spec (every group flat). A layer's parameters
    are put through the groups rule once per layer kind (named as layer 0's), a search's
    layouts sharing the rows of one measured layer."""

    def answer():
        spec, hyper = optimizer_settings(cfg)
        if spec.elementwise:
            return ()
        key = (spec.name, modules.frozen(hyper))
        own, moe = _chunk_own(cfg, pp_rank, chunk), _chunk_moe(cfg, pp_rank, chunk)
        rows = _rows(own, own.named, spec, hyper, key)
        cut = len(own.before)
        layers = {e: _rows(m, [(f"layers.0.{n}", q) for n, q in m.named], spec, hyper, key)
                  for e in set(moe) for m in [modules.layer_params(cfg, e)]}  # fmt: skip
        return rows[:cut] + tuple(r for e in moe for r in layers[e]) + rows[cut:]

    return modules.per_config(cfg, ("optimizer_rows", pp_rank, chunk), answer)


_ROWS: dict[tuple, tuple] = {}  # (id(measured), settings) -> (measured, its rows), bounded


def _rows(measured, named, spec: OptimizerSpec, hyper: dict, key: tuple) -> tuple:
    """The OptimizerRows of `named` ((name, parameter) of `measured`, a cached LayerParams or
    ChunkParams: remembered while it is the same object)."""
    hit = _ROWS.get((id(measured), key))
    if hit is not None and hit[0] is measured:
        return hit[1]
    groups = spec.param_groups(hyper)
    rows = []
    for name, q in named:
        g = groups[group_index(spec, groups, q, name)]
        whole = not spec.group_elementwise(g)
        cost = spec.cost(q, hyper) if whole and spec.cost else q.numel()
        meta = meta_of(q)
        sharded = whole and meta.tp_dim is not None and meta.tp_size > 1 and not meta.is_expert
        rows.append(OptimizerRow(q.numel(), meta.is_expert, whole, spec.group_state_bytes(g),
                                 cost, sharded))  # fmt: skip
    if len(_ROWS) >= 4096:
        _ROWS.clear()
    _ROWS[(id(measured), key)] = (measured, tuple(rows))
    return tuple(rows)
