"""Per-rank memory of a layout: model states (the ZeRO table of
parallel/data_parallel/memory.py, reused), activations by schedule, embedding/logits/loss, and
the working sets that exist only during part of a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel.memory import TERMS, formula_bytes, zero2_in_flight
from megatron_lite.pipeline.schedules import virtual_stage
from megatron_lite.plan.activations import (
    chunk_bytes,
    head_terms,
    in_flight,
    layer_bytes,
    layer_shape,
    resolved,
    rope_table_bytes,
)
from megatron_lite.resolve import (
    is_moe_layer,
    moe_ffn_hidden_size,
    num_microbatches,
    num_query_groups,
    padded_vocab_size,
    stage_layers,
)


def layer_params(cfg: Config, moe: bool) -> tuple[int, int]:
    """(dense, expert) parameters of one layer on one TP/EP rank."""
    m, p = cfg.model, cfg.parallel
    h, n, t = m.hidden_size, m.num_attention_heads, p.tp
    d, g = h // n, num_query_groups(m)
    gpt = m.arch == "gpt"
    gated = 2 if gpt else 3
    dense = (h * (n + 2 * g) * d + n * d * h) // t + (4 if gpt else 2) * h
    if gpt:
        dense += (n + 2 * g) * d // t + h
    if not moe:
        f = m.ffn_hidden_size
        return dense + gated * h * f // t + ((f // t + h) if gpt else 0), 0
    f = moe_ffn_hidden_size(m)
    return dense + h * m.num_experts, m.num_experts // p.ep * gated * h * f


def rank_layers(cfg: Config, pp_rank: int) -> list[tuple[int, int]]:
    """(first layer index, layer count) of each model chunk on pipeline rank `pp_rank`."""
    counts, p = stage_layers(cfg.model, cfg.parallel), cfg.parallel
    stages = (virtual_stage(pp_rank, c, p.pp) for c in range(p.vpp))
    return [(sum(counts[:s]), counts[s]) for s in stages]


def rank_params(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameters this pipeline rank holds on one TP/EP rank."""
    m, p = cfg.model, cfg.parallel
    dense = expert = 0
    for first, count in rank_layers(cfg, pp_rank):
        for i in range(first, first + count):
            dn, ex = layer_params(cfg, is_moe_layer(m.num_experts, m.moe_layer_freq, i))
            dense, expert = dense + dn, expert + ex
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp) * m.hidden_size
    if pp_rank == 0:
        dense += vocab // p.tp
        if m.arch == "gpt":
            dense += (m.max_position_embeddings or m.seq_length) * m.hidden_size
    if pp_rank == p.pp - 1:
        dense += (2 if m.arch == "gpt" else 1) * m.hidden_size  # final norm
        if not (m.tie_embeddings and p.pp == 1):
            dense += vocab // p.tp
    return dense, expert


def largest_params(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) elements of the largest parameter this pipeline rank holds on one TP/EP
    rank (a gradient bucket holds fewer than bucket_size + it)."""
    m, p = cfg.model, cfg.parallel
    h, n, t = m.hidden_size, m.num_attention_heads, p.tp
    d, g, up = h // n, num_query_groups(m), 1 if m.arch == "gpt" else 2  # fc1: [up·f/tp, h]
    layers = [i for first, count in rank_layers(cfg, pp_rank) for i in range(first, first + count)]
    moe = [is_moe_layer(m.num_experts, m.moe_layer_freq, i) for i in layers]
    dense, expert = [h * (n + 2 * g) * d // t, n * d * h // t], 0
    if not all(moe):
        dense.append(up * m.ffn_hidden_size * h // t)
    if any(moe):
        dense.append(m.num_experts * h)  # the router
        expert = m.num_experts // p.ep * up * moe_ffn_hidden_size(m) * h
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp) * h // p.tp
    if pp_rank == 0:
        dense.append(vocab)
        if m.arch == "gpt":
            dense.append((m.max_position_embeddings or m.seq_length) * h)
    if pp_rank == p.pp - 1 and not (m.tie_embeddings and p.pp == 1):
        dense.append(vocab)
    return max(dense), expert


def model_states(cfg: Config, pp_rank: int) -> dict[str, float]:
    """{weights, grads, master, optimizer} bytes on this rank: memory.formula_bytes for the
    dense parameters sharded over dp·cp (or dp_shard) and the experts over dp·cp/ep, with the
    gradients of the step's peak: ZeRO-2's buckets in flight (two per reduction group, over
    all model chunks), ZeRO-3's unsharded gradients under gradient accumulation."""
    p = cfg.parallel
    dense, expert = rank_params(cfg, pp_rank)
    n_dense = p.dp_shard or p.dp * p.cp
    n_expert = p.dp_shard or max(p.dp * p.cp // p.ep, 1)
    extra = dict(
        microbatches=num_microbatches(cfg.train, p.dp),
        reduce_bytes=2 if p.grad_reduce_dtype == "bf16" else 4,
    )
    out = dict.fromkeys(TERMS, 0.0)
    for count, n, largest in zip(
        (dense, expert), (n_dense, n_expert), largest_params(cfg, pp_rank), strict=True
    ):
        if count:
            in_flight = zero2_in_flight(count, p.ddp_bucket_size, largest)
            terms = formula_bytes(
                count, cfg.train.precision, p.zero_stage, n, in_flight=in_flight, **extra
            )
            for k, v in terms.items():
                out[k] += v
    return out


@dataclass
class RankMemory:
    """One pipeline rank's peak memory by term (bytes), and what produced it."""

    pp_rank: int
    terms: dict[str, float]
    in_flight: int  # (microbatch, chunk) pairs held at the peak
    per_layer: dict[str, float] = field(default_factory=dict)  # one layer, one microbatch

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def rank_memory(cfg: Config, world: int, pp_rank: int, kernels: str = "fused") -> RankMemory:
    """Peak bytes on pipeline rank `pp_rank` (the largest over its TP/DP/CP ranks)."""
    r = resolved(cfg, world)
    p = r.parallel
    shape = layer_shape(r, kernels)
    m = num_microbatches(r.train, p.dp)
    held = in_flight(p.pp, p.vpp, m, pp_rank)
    chunks = rank_layers(r, pp_rank)
    per_chunk = [chunk_bytes(r, shape, count) for _, count in chunks]
    # interleaved: the held pairs spread over the chunks, earlier chunks first
    layers_act = held / len(chunks) * sum(k for k, _ in per_chunk)
    working = max((w for _, w in per_chunk), default=0.0)
    head = head_terms(r, shape)
    terms = model_states(r, pp_rank)
    terms["buffers"] = len(chunks) * rope_table_bytes(shape)  # RoPE's tables, per chunk
    terms["activations"] = layers_act
    embed_held = -(-held // p.vpp) if pp_rank == 0 else 0
    terms["embedding"] = embed_held * head["embedding"]
    last = pp_rank == p.pp - 1
    terms["logits_loss"] = head["final_norm"] + head["output_in"] + head["logits"] if last else 0.0
    logits_working = head["logits_grad"] if last else 0.0
    zero3 = 0.0
    if p.zero_stage == 3:  # the gathered weights of the unit in use and the prefetched next one
        dense, _ = rank_params(r, pp_rank)
        per_layer_w = dense / max(sum(c for _, c in chunks), 1)
        zero3 = 2 * per_layer_w * (2 if r.train.precision == "bf16" else 4)
        if m == 1:  # the unit's unsharded gradients until its reduce-scatter (m > 1: in grads)
            zero3 += per_layer_w * (2 if p.grad_reduce_dtype == "bf16" else 4)
    terms["working"] = max(working, logits_working) + zero3
    return RankMemory(pp_rank, terms, held, layer_bytes(r, shape))


def plan_memory(cfg: Config, world: int, kernels: str = "fused") -> list[RankMemory]:
    """Every pipeline rank's memory (index = pp rank)."""
    return [rank_memory(cfg, world, r, kernels) for r in range(cfg.parallel.pp)]
