"""Parameter counts of one rank, as the model code lays them out: per layer, per model chunk
(in registration order, what the gradient buffers cut into buckets), per pipeline rank, and
the units FSDP2 gathers (ZeRO-3). On one TP/EP rank; TP and EP shards are even."""

from __future__ import annotations

import functools

from megatron_lite.config import Config
from megatron_lite.pipeline.schedules import schedule_placement, virtual_stage
from megatron_lite.resolve import (
    kv_channels,
    moe_ffn_hidden_size,
    moe_layer_pattern,
    num_query_groups,
    padded_vocab_size,
    stage_layers,
)

Param = tuple[int, bool]  # (elements, is_expert)


def layer_param_list(cfg: Config, moe: bool) -> list[Param]:
    """One transformer layer's parameters in registration order (models/transformer.py):
    input norm, qkv, (q and k norms with qk_layernorm), proj, pre-MLP norm, then fc1, fc2 (or the
    router and the stacked experts' weight1, weight2, then the shared expert's fc1, fc2 on the
    dense MLP's TP layout)."""
    return list(_layer(cfg, moe)[0])


def layer_linear_weights(cfg: Config, moe: bool) -> int:
    """Elements of one layer's parallel-linear weights (qkv, proj, fc1, fc2 or the shared
    expert's), those whose gradient GEMM a split backward queues for W (linear_async)."""
    return _layer(cfg, moe)[1]


def _layer(cfg: Config, moe: bool) -> tuple:
    m, p = cfg.model, cfg.parallel
    shared = m.moe_shared_expert_ffn_hidden_size or 0
    experts = (m.num_experts, moe_ffn_hidden_size(m), p.ep, shared) if moe else None
    h, n, g = m.hidden_size, m.num_attention_heads, num_query_groups(m)
    d, qk_norm = kv_channels(m), m.qk_layernorm
    return _layer_list(m.arch, h, n, g, m.ffn_hidden_size, p.tp, experts, d, qk_norm)


@functools.lru_cache(maxsize=4096)  # the search asks for the same few shapes many times
def _layer_list(
    arch: str, h: int, n: int, g: int, f: int, t: int, experts, d: int, qk_norm: bool
) -> tuple:
    """(the layer's parameters, the elements of its parallel-linear weights)."""
    gpt = arch == "gpt"  # d: the head dim (model.kv_channels), qk_norm: model.qk_layernorm
    norm = [(h, False), (h, False)] if gpt else [(h, False)]
    qk_norms = ([(d, False), (d, False)] if gpt else [(d, False)]) * 2 if qk_norm else []
    weights = []  # the linear weights' elements

    def linear(out: int, inp: int, bias: int) -> list[Param]:
        weights.append(out * inp)
        return [(out * inp, False)] + ([(bias, False)] if gpt else [])

    qkv = (n + 2 * g) * d
    out = norm + linear(qkv // t, h, qkv // t) + qk_norms + linear(h, n * d // t, h) + norm
    up = 1 if gpt else 2
    if experts is not None:
        e, f_e, ep, f_s = experts
        local = e // ep
        out += [(e * h, False), (local * up * f_e * h, True), (local * h * f_e, True)]
        if f_s:  # the shared expert: a dense MLP of width f_s
            out += linear(up * f_s // t, h, up * f_s // t) + linear(h, f_s // t, h)
        return tuple(out), sum(weights)
    out += linear(up * f // t, h, up * f // t) + linear(h, f // t, h)
    return tuple(out), sum(weights)


def layer_params(cfg: Config, moe: bool) -> tuple[int, int]:
    """(dense, expert) parameters of one layer on one TP/EP rank."""
    params = layer_param_list(cfg, moe)
    return sum(n for n, e in params if not e), sum(n for n, e in params if e)


def placement(cfg: Config) -> str:
    """Where the pipeline schedule's record puts the virtual stages ("loop" or "v")."""
    return schedule_placement(cfg.parallel.pipeline_schedule, cfg.parallel.vpp)


def rank_layers(cfg: Config, pp_rank: int) -> list[tuple[int, int]]:
    """(first layer index, layer count) of each model chunk on pipeline rank `pp_rank`."""
    counts, p = stage_layers(cfg.model, cfg.parallel), cfg.parallel
    stages = (virtual_stage(pp_rank, c, p.pp, placement(cfg)) for c in range(p.vpp))
    return [(sum(counts[:s]), counts[s]) for s in stages]


def chunk_moe(cfg: Config, pp_rank: int, chunk: int) -> list[bool]:
    """Whether each layer of the model chunk is an MoE layer."""
    m = cfg.model
    first, count = rank_layers(cfg, pp_rank)[chunk]
    return moe_layer_pattern(m)[first : first + count]


def head_params(cfg: Config, pp_rank: int, chunk: int) -> tuple[list[Param], list[Param]]:
    """(before the layers, after them) of a chunk: the embedding (and GPT's positions) on
    virtual stage 0, the final norm and output layer on the last."""
    m, p = cfg.model, cfg.parallel
    stage, last = virtual_stage(pp_rank, chunk, p.pp, placement(cfg)), p.pp * p.vpp - 1
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp)
    rows = vocab // p.tp * m.hidden_size
    before, after = [], []
    if stage == 0:
        before.append((rows, False))
        if m.arch == "gpt":
            before.append(((m.max_position_embeddings or m.seq_length) * m.hidden_size, False))
    if stage == last:
        after += [(m.hidden_size, False)] * (2 if m.arch == "gpt" else 1)  # final norm
        if not (m.tie_embeddings and p.pp == 1):
            after.append((rows, False))
    return before, after


def chunk_param_list(cfg: Config, pp_rank: int, chunk: int) -> list[Param]:
    """Every parameter of a model chunk in registration order (models/chunk.py)."""
    before, after = head_params(cfg, pp_rank, chunk)
    moe = chunk_moe(cfg, pp_rank, chunk)
    lists = {e: layer_param_list(cfg, e) for e in set(moe)}
    return before + [q for e in moe for q in lists[e]] + after


def rank_params(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameters this pipeline rank holds on one TP/EP rank."""
    params = [q for c in range(cfg.parallel.vpp) for q in chunk_param_list(cfg, pp_rank, c)]
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
    multiple of `shard`."""
    m, p = cfg.model, cfg.parallel
    before, after = head_params(cfg, pp_rank, chunk)
    layers = [q for moe in chunk_moe(cfg, pp_rank, chunk) for q in layer_param_list(cfg, moe)]
    params = before + layers + after
    alone = set()
    if m.tie_embeddings and p.pp > 1:  # the embedding, the last stage's output weight
        alone = ({0} if before else set()) | ({len(params) - 1} if after else set())
    out, size, count = [], 0, 0
    for i in reversed(range(len(params))):
        n, is_expert = params[i]
        if is_expert != expert:
            continue
        if i in alone and size:
            out.append((-(-size // shard) * shard, count))
            size = count = 0
        size, count = size + n, count + 1
        if i in alone or size >= p.ddp_bucket_size:
            out.append((-(-size // shard) * shard, count))
            size = count = 0
    if size:
        out.append((-(-size // shard) * shard, count))
    return out


def fsdp_units(cfg: Config, pp_rank: int, chunk: int) -> tuple[int, list[int]]:
    """ZeRO-3 (parallel/data_parallel/fsdp.py): (the chunk root's parameters: embedding, final
    norm, output layer; each layer's, its experts included), the units FSDP2 gathers."""
    before, after = head_params(cfg, pp_rank, chunk)
    moe = chunk_moe(cfg, pp_rank, chunk)
    size = {e: sum(n for n, _ in layer_param_list(cfg, e)) for e in set(moe)}
    return sum(n for n, _ in before + after), [size[e] for e in moe]
