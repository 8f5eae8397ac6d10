"""Reference formulas for the planner's measured activation figures (tests only): the per-term
formulas the planner used before it measured the real modules (plan/saved.py), Korthikanti et
al. 2022's Table 2 and Megatron-LM's theoretical memory. Independent checks: the tests compare
the measured figures to these within stated tolerances. What follows is the former
plan/activations.py's text.

Activation bytes saved for backward, per transformer layer and per pipeline stage.

Derived from what our layers keep for backward (models/transformer.py, parallel/layers.py,
moe/, kernels/, parallel/cross_entropy.py), per microbatch, on one rank, as unique storages
(the SavedTensorMeter's unit), and checked against the dry run (plan --dry-run,
tools/bench_dry_run.py). Notation: T = (s/cp)·b local tokens, u = 1/tp with sequence
parallelism (else 1), A = bytes of the compute dtype (bf16 2, fp32 4), R = bytes of the residual
stream, n heads and g KV groups of width d, f the MLP width. Per layer:

| term | saved by | bytes |
|---|---|---|
| norms | 2 norms: input (+ x+attn) and rstd (LayerNorm: + mean) | 2·(T·h·u·R + 4·T·u) (LN 8·T·u) |
| qkv_in, fc1_in | column-parallel linears' input | T·h·A each (SP, shard saved: /tp) |
| qkv_out | v is a view of the qkv output, so attention keeps it (a2a = 1) | T·(n+2g)·d/tp·A |
| attn_in | RoPE'd q, k (a2a = 1) | T·(n+g)·d/tp·A |
| attn_in | Ulysses all-to-all outputs (a2a > 1) | T·(n/tp + 2·max(g/tp, a2a))·d·A |
| attn_out, attn_stats | flash/SDPA output and fp32 log-sum-exp | T·n·d/tp·A, 4·T·n/tp |
| attn_out (ring) | ring attention's fp32 accumulator (ring > 1, also in bf16) | 4·T·n·d/tp |
| proj_in | row-parallel input: Ulysses' output, the ring's bf16 copy (else attn_out) | T·n·d/tp·A |
| act | SwiGLU: contiguous gate and up (GeLU: its input) | 2·T·f/tp·A (GeLU T·f/tp·A) |
| fc2_in | row-parallel linear's input | T·f/tp·A |
| dropout | two bool masks (hidden_dropout > 0) | 2·T·h·u |

flash-attn and SDPA return their output in q's [s, b, n, d] layout, so the reshape to
[s, b, n·d] and the row-parallel linear's input are that storage (any micro batch size).

Context parallelism (parallel.cp_comm_type; cp = a2a · ring, resolve.cp_a2a_size): a2a is
Ulysses over all cp ranks (ring = 1), p2p the ring alone (a2a = 1), a2a+p2p Ulysses over a2a
ranks inside a ring of cp/a2a. Every term holds T = (s/cp)·b tokens, so it falls as 1/cp, but
for Ulysses' KV replication up to a2a heads (g/tp < a2a). Ring attention (context/ring.py)
saves its inputs q, k, v (a2a = 1: RoPE'd q, k and v, a view of the qkv output, as without
CP; a2a > 1: the Ulysses all-to-all output), its fp32 output accumulator and fp32
log-sum-exp (its masks are built when used, never kept).
The accumulator takes q's [s, b, n, d] layout, so the returned output, a bf16 copy or (fp32)
the accumulator itself, reshapes to [s, b, n·d] as a view: proj_in is the bf16 copy, nothing
new in fp32. It is never recomputed (selective core_attn keeps it).

An MoE layer (moe/layer.py; N = T·u·k rows of its T·u tokens, top-k, sent and received under
a dry run's balanced dropless routing; E experts of width f_e) saves, instead of fc1_in, act
and fc2_in:

| term | saved by | bytes |
|---|---|---|
| router_in | the router's fp32 copy of its input (its GEMM's) | 4·T·u·h |
| router | softmax probabilities and logits, top-k ids | 8·T·u·E + 8·T·u·k |
| expert_in | the experts' input after the all-to-all and regrouping | N·h·A |
| expert_act, expert_fc2_in | each expert's SwiGLU gate and up, its fc2 input | 2·N·f_e·A, N·f_e·A |
| combine | all-to-all output (kept by the weighting), weighted rows (by index_add) | 2·N·h·A |
| routing | token ids and the regroup order (int64), router weights (fp32) | 20·N |
| shared_fc1_in | the shared expert's fc1 input: the MoE input (fp32: router_in) | T·u·h·A |
| shared_act | its SwiGLU gate and up (width f_s; GeLU: its input) | 2·T·f_s/tp·A |
| shared_fc2_in | its fc2 input | T·f_s/tp·A |

Kernels "torch" (the plain-torch references that run on CPU) save fp32 intermediates instead:
RMSNorm its fp32 input and the normalized product (8·T·h·u + 4·T·u; bf16: + the weight's fp32
copy 4·h), LayerNorm its fp32 input, mean and rstd (bf16: + fp32 weight and bias), SwiGLU three fp32
[T, f/tp] tensors. RoPE saves nothing of its own: autograd keeps a product's other factor only
for the factor that needs a gradient, and those factors are the chunk's cos/sin buffers
(`rope_table_bytes`, one pair per chunk whatever the microbatches in flight: not activations).

The "paper" architecture (Korthikanti et al. 2022, GPT in fp16 with dropout and the attention
scores materialized) is the same engine with: A = R = 2, no norm statistics, no RoPE, and the
attention internals replaced by softmax output (2), dropout mask (1) and dropout output (2)
bytes per score, b·s²·n/tp scores. It reproduces their Table 2: s·b·h·(34 + 5·n·s/h) without
parallelism, s·b·h·(10 + 24/t + 5·n·s/(h·t)) with TP, 34·s·b·h/t with TP+SP and selective
recompute, 2·s·b·h with full recompute (tests/unit/test_plan_formulas.py).

Recompute (model.recompute_granularity / recompute_modules / recompute_method /
recompute_num_layers, Megatron's names): selective drops the internals of the listed modules
(core_attn: attn_out and attn_stats, or the scores; mlp: act and fc2_in; moe: every MoE term,
its input T·u·h·A kept by the recompute) and keeps their inputs; full keeps each recomputed
group's input (T·h·u·R) and rebuilds the rest of the group's activations during its backward.

What exists only for a moment (working sets) is plan/working.py's; the moment of a rank's peak,
and every term then, is plan/peak.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.plan.activations import LayerShape as PlannerShape
from megatron_lite.resolve import (
    cp_a2a_size,
    kv_channels,
    moe_ffn_hidden_size,
    num_query_groups,
    padded_vocab_size,
    recompute_modules,
    resolve,
    sequence_parallel,
)
from megatron_lite.validation.recompute import RECOMPUTE_MODULES

SELECTIVE_MODULES = RECOMPUTE_MODULES  # what the model can recompute (validation's list)


@dataclass(frozen=True)
class LayerShape(PlannerShape):
    """The planner's layer sizes plus the architecture these formulas switch on."""

    arch: str = "llama"  # llama | gpt | paper


def norm_bytes(x: LayerShape) -> float:
    """One norm's saves: its input and rstd (LayerNorm: + mean); the torch RMSNorm reference
    keeps its fp32 input and normalized product; the paper counts the input only."""
    T, u = x.tokens, x.u
    if x.arch == "paper":
        return T * x.h * u * x.residual_bytes
    copies = x.act_bytes != 4  # bf16 references upcast: fp32 input and weight (+ bias) copies
    if x.kernels == "torch" and x.arch == "llama":
        return 8 * T * x.h * u + 4 * T * u + (4 * x.h if copies else 0)
    if x.kernels == "torch":
        return 4 * T * x.h * u + 8 * T * u + (8 * x.h if copies else 0)
    return T * x.h * u * x.residual_bytes + (8 if x.arch == "gpt" else 4) * T * u


def layer_terms(x: LayerShape, moe: bool = False) -> dict[str, float]:
    """{term: bytes} one layer saves for backward on one rank, one microbatch, no recompute
    (moe: an MoE layer, whose MLP terms are moe_terms)."""
    T, u, A, t = x.tokens, x.u, x.act_bytes, x.tp
    d = x.d
    paper, torch_k = x.arch == "paper", x.kernels == "torch"
    out: dict[str, float] = {"norms": 2 * norm_bytes(x)}
    lin_in = T * x.h * A / (t if x.sp else 1)  # SP: the linears keep their [s/tp] input
    out["qkv_in"] = lin_in
    rope = x.arch == "llama"  # RoPE keeps only the chunk's cos/sin buffers (rope_table_bytes)
    a2a, ring = x.a2a, x.ring
    out["qkv_out"] = T * (x.n + 2 * x.g) * d / t * A if a2a == 1 else 0.0
    if a2a > 1:
        out["attn_in"] = T * (x.n / t + 2 * max(x.g / t, a2a)) * d * A
    elif rope:
        out["attn_in"] = T * (x.n + x.g) * d / t * A
    if paper:  # softmax output (2), dropout mask (1), dropout output (2) per score
        out["attn_out"] = 5 * x.b * x.s * x.s * x.n / t
    else:  # the ring keeps its fp32 accumulator, flash/SDPA their output
        out["attn_out"] = T * x.n * d / t * (4 if ring > 1 else A)
        out["attn_stats"] = 4 * T * x.n / t  # fp32 log-sum-exp per head and token
    # flash-attn and SDPA give their output q's [s, b, n, d] layout, so the reshape to
    # [s, b, n·d] is a view (one storage); Ulysses' all-to-all makes a new tensor
    # (the ring's accumulator takes q's [s, b, n, d] layout: in fp32 its returned output is
    # that storage, in bf16 a copy)
    copied = a2a > 1 or (ring > 1 and A != 4) or paper
    out["proj_in"] = T * x.n * d / t * A if copied else 0.0
    if moe:
        return out | moe_terms(x)
    out["fc1_in"] = lin_in
    if x.arch == "llama":
        out["act"] = 3 * T * x.f / t * 4 if torch_k else 2 * T * x.f / t * A
    else:
        out["act"] = T * x.f / t * A
    out["fc2_in"] = T * x.f / t * A
    out["dropout"] = 2 * T * x.h * u if (x.dropout or paper) else 0.0
    return out


def deferred_wgrad_bytes(x: LayerShape, moe: bool = False) -> float:
    """Bytes one layer's queued weight-gradient GEMMs keep from its B to its W (zero-bubble
    schedules: linear_async.defer_wgrad), one microbatch: each parallel linear's input as the
    GEMM reads it (the column-parallel ones' [s, b, h], all-gathered under SP) and its output
    gradient (the row-parallel ones' [s, b, h], before their reduce-scatter), in the compute
    dtype. An MoE layer's experts and router run their weight gradients in B; its shared
    expert is on the dense MLP's linears."""
    T, A, t, d = x.tokens, x.act_bytes, x.tp, x.d
    qkv, core = (x.n + 2 * x.g) * d / t, x.n * d / t
    out = (x.h + qkv) + (core + x.h)  # linear_qkv, linear_proj: input + output gradient
    width = x.shared_f if moe else x.f
    if width:
        up = (2 if x.gated else 1) * width / t
        out += (x.h + up) + (width / t + x.h)  # fc1, fc2
    return T * A * out


def moe_assignments(x: LayerShape) -> float:
    """(token, expert) rows one rank sends and receives per MoE layer and microbatch: its
    T·u tokens times top-k (a dry run's balanced, dropless routing)."""
    return x.tokens * x.u * x.topk


def moe_terms(x: LayerShape) -> dict[str, float]:
    """What an MoE layer (moe/layer.py) saves instead of the MLP's terms, N = moe_assignments:
    the router's fp32 input, the expert input after the all-to-all, each expert's SwiGLU inputs
    and fc2 input, the combine's weighted rows (the all-to-all output and its product with the
    router weights, which index_add keeps), and the routing indices and weights."""
    T, A, h, f, n = x.tokens * x.u, x.act_bytes, x.h, x.moe_f, moe_assignments(x)
    return {
        "router_in": 4 * T * h,
        "router": 2 * 4 * T * x.experts + 8 * T * x.topk,  # probs, logits; top-k ids
        "expert_in": n * h * A,
        "expert_act": (2 if x.gated else 1) * n * f * A,
        "expert_fc2_in": n * f * A,
        "combine": 2 * n * h * A,
        "routing": n * (8 + 8 + 4),  # token ids, regroup order (int64), weights (fp32)
    } | shared_expert_terms(x)


def shared_expert_terms(x: LayerShape) -> dict[str, float]:
    """The MoE layer's shared expert (a dense MLP of width shared_f on the dense MLP's TP/SP
    layout, fed the MoE input): its fc1 input (the MoE input, already the router's fp32 copy in
    fp32), SwiGLU's inputs (GeLU: its input) and fc2 input. Zeros without one."""
    T, A, t, f = x.tokens, x.act_bytes, x.tp, x.shared_f
    torch_k = x.kernels == "torch"
    if not f:
        return {"shared_fc1_in": 0.0, "shared_act": 0.0, "shared_fc2_in": 0.0}
    if x.gated:
        act = 3 * T * f / t * 4 if torch_k else 2 * T * f / t * A
    else:
        act = T * f / t * A
    return {
        "shared_fc1_in": 0.0 if A == 4 else T * x.h * A / (t if x.sp else 1),
        "shared_act": act,
        "shared_fc2_in": T * f / t * A,
    }


MOE_TERMS = tuple(moe_terms(LayerShape(1, 1, 1, 1, 1, 1, topk=1, arch="llama")))


def rope_table_bytes(x: LayerShape) -> float:
    """RoPE's fp32 cos/sin tables [s/cp, d]: buffers, one pair per model chunk."""
    return 2 * x.s / x.cp * x.d * 4 if x.arch == "llama" else 0.0


def layer_input_bytes(x: LayerShape) -> float:
    """A layer's input (the residual stream), what full recompute keeps."""
    return x.tokens * x.h * x.u * x.residual_bytes


def selective(
    terms: dict[str, float], modules: list[str] | tuple[str, ...], moe_in: float = 0.0
) -> dict[str, float]:
    """Terms left when the listed modules are recomputed in backward (their inputs stay; an
    MoE layer's input, `moe_in` bytes, is then kept by the recompute)."""
    unknown = [m for m in modules if m not in SELECTIVE_MODULES]
    if unknown:
        raise ValueError(
            f"model.recompute_modules: {unknown} not modelled; the planner knows "
            f"{', '.join(SELECTIVE_MODULES)}"
        )
    out = dict(terms)
    drop = {"core_attn": ("attn_out", "attn_stats"), "mlp": ("act", "fc2_in"), "moe": MOE_TERMS}
    if "core_attn" in modules and not out["proj_in"]:  # the output doubled as proj's input
        out["proj_in"] = out["attn_out"]
    if "moe" in modules and "router_in" in out:
        out["moe_in"] = moe_in
    for m in modules:
        for k in drop[m]:
            if k in out:
                out[k] = 0.0
    return out


# ----------------------------------------------------------------------------- from a config
def recompute_settings(cfg: Config) -> tuple[str | None, list[str], str, int]:
    """(granularity, modules, method, num_layers) from model.recompute_* (Megatron's names)."""
    m = cfg.model
    modules = recompute_modules(m)  # () unless selective
    method = m.recompute_method or "uniform"  # unvalidated configs (the search) may leave it
    return m.recompute_granularity, list(modules), method, int(m.recompute_num_layers or 1)


def residual_bytes(cfg: Config) -> int:
    """The residual stream's bytes: fp32 unless bf16 training without fp32_residual_connection."""
    if cfg.train.precision != "bf16":
        return 4
    return 4 if cfg.model.fp32_residual_connection else 2


def resolved(cfg: Config, world: int) -> Config:
    """`cfg` itself when its derived fields are filled in (validate()'s output), else resolve."""
    m = cfg.model
    done = cfg.parallel.dp is not None and m.ffn_hidden_size and m.num_query_groups
    return cfg if done else resolve(cfg, world)


def layer_shape(cfg: Config, kernels: str = "fused") -> LayerShape:
    p = cfg.parallel
    m = resolved(cfg, p.tp * p.pp * p.cp * (p.dp or 1)).model
    return LayerShape(
        arch=m.arch, s=m.seq_length, b=cfg.train.micro_batch_size, h=m.hidden_size,
        n=m.num_attention_heads, g=num_query_groups(m), f=m.ffn_hidden_size, tp=p.tp,
        sp=sequence_parallel(p), cp=p.cp, ring=p.cp // cp_a2a_size(p),
        act_bytes=2 if cfg.train.precision == "bf16" else 4,
        residual_bytes=residual_bytes(cfg), dropout=m.hidden_dropout > 0, kernels=kernels,
        experts=m.num_experts or 0, topk=m.moe_router_topk if m.num_experts else 0,
        moe_f=moe_ffn_hidden_size(m) if m.num_experts else 0, ep=p.ep, gated=m.arch != "gpt",
        main_grad=p.zero_stage < 3, head_dim=kv_channels(m),
        shared_f=m.moe_shared_expert_ffn_hidden_size if m.num_experts else 0,
        grouped_gemm=m.moe_grouped_gemm,
    )  # fmt: skip


def layer_bytes(cfg: Config, shape: LayerShape, moe: bool = False) -> dict[str, float]:
    """Per-layer terms under the config's recompute mode, and 'full' recompute's input."""
    gran, modules, _, _ = recompute_settings(cfg)
    terms = layer_terms(shape, moe)
    if shape.ring > 1:  # ring attention is never recomputed (models/transformer.py)
        modules = [mod for mod in modules if mod != "core_attn"]
    if gran == "selective":
        moe_in = shape.tokens * shape.u * shape.h * shape.act_bytes  # the recompute's input
        return selective(terms, modules, moe_in)
    if gran == "full":
        return {"input": layer_input_bytes(shape)}
    return terms


def chunk_bytes(cfg: Config, shape: LayerShape, moe: list[bool]) -> tuple[float, float]:
    """(bytes kept per microbatch by the layers of one model chunk, `moe[i]` whether its i-th
    layer is an MoE layer; under full recompute the activations one recomputed group rebuilds
    during its backward, all of its layers' but the kept input, else 0)."""
    gran, _, method, num = recompute_settings(cfg)
    kinds = set(moe)
    if gran != "full":
        kept = {e: sum(layer_bytes(cfg, shape, e).values()) for e in kinds}
        return sum(kept[e] for e in moe), 0.0
    whole = {e: sum(layer_terms(shape, e).values()) for e in kinds}
    full = [whole[e] for e in moe]
    inp = layer_input_bytes(shape)
    if method == "block":
        k = min(num, len(moe))
        return k * inp + sum(full[k:]), max(full[:k], default=inp) - inp
    groups = [sum(full[i : i + num]) for i in range(0, len(moe), num)]
    return len(groups) * inp, max(groups, default=inp) - inp  # (the group's input is kept)


def head_terms(cfg: Config, shape: LayerShape) -> dict[str, float]:
    """Embedding (first stage) and final norm, output layer input, logits and loss (last stage),
    per microbatch: {term: bytes}. Logits are saved as fp32 vocab-parallel chunks [T, V/tp]."""
    m = cfg.model
    T, u, A, t = shape.tokens, shape.u, shape.act_bytes, shape.tp
    v_local = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t) / t
    lin_in = T * shape.h * A / (t if shape.sp else 1)
    return {
        # int64 ids and a bool mask per token (+ the dropout mask)
        "embedding": 9 * T + (T * shape.h * u if shape.dropout else 0.0),
        "final_norm": norm_bytes(shape),
        "output_in": lin_in,
        "logits": 4 * T * v_local + 12 * T,  # fp32 logits, lse (4) and int64 targets (8)
        # the loss backward's fp32 gradient beside the saved logits (torch: exp, then × dloss)
        "logits_grad": (8 if shape.kernels == "torch" else 4) * T * v_local,
        "embedding_grad": v_local * shape.h * A,  # its dense weight gradient, in backward
    }


# ----------------------------------------------------------------------- published formulas
def korthikanti(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2 (bytes per layer, fp16): none (t = 1 no parallelism),
    tp, tp_sp_selective, full."""
    if mode == "none":
        return s * b * h * (34 + 5 * a * s / h) if t == 1 else korthikanti(s, b, h, a, t, "tp")
    if mode == "tp":
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "tp_sp_selective":
        return 34 * s * b * h / t
    if mode == "full":
        return 2 * s * b * h
    raise ValueError(mode)


def megatron_theoretical(s: int, b: int, h: int, f: int, t: int) -> float:
    """Megatron-LM's theoretical_memory_usage.compute_activation_memory per layer (it assumes
    SP and selective recompute): s·b·h·(18 + 4·f/h) / t. Equal to Korthikanti's 34·s·b·h/t
    for GPT (f = 4h). For Llama it counts three h-wide Q, K, V (GQA keeps the qkv output and
    RoPE'd q, k: less), one f-wide MLP intermediate less than SwiGLU keeps, and two dropout
    masks Llama does not have: Llama-3 70B tp8 256 MiB against our 286 MiB."""
    return s * b * h * (18 + 4 * f / h) / t


# ------------------------------------------------------------- the former hand parameter count
import functools  # noqa: E402

Param = tuple[int, bool]  # (elements, is_expert)


def hand_layer_params(cfg: Config, moe: bool) -> tuple:
    """(one layer's parameters in registration order, its parallel-linear weights' elements)
    by the former plan/params.py's hand count (llama: RMSNorm, SwiGLU, no biases; gpt:
    LayerNorm, GeLU, biases)."""
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
