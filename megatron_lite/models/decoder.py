"""What the shipped decoders (llama.py, gpt.py) share as registry facts: FLOPs per token of the
pre-norm decoder built from `Attention` / `MLP` / `MoELayer`, and the rotary head-dim rule.

FLOPs per token, forward + backward = 3 × the forward's matmul FLOPs (backward: one GEMM for
the input gradient and one for the weight gradient per forward GEMM), a multiply-add counted as
2 FLOPs:

    6·N_active + 6·L·s·q

N_active: the weights every token multiplies, i.e. per layer the attention projections
h·(q + 2·kv) + q·h (q = heads·head_dim, kv = query_groups·head_dim with head_dim =
model.kv_channels, so q may differ from h; grouped-query attention at its real width), the dense
MLP (3·h·ffn with SwiGLU, 2·h·ffn with GeLU) or for a MoE layer the router h·E plus topk experts'
MLPs (and the shared expert's, with its gate's h·1), and the output layer h·V (V the unpadded
vocabulary; counted when tied too, its GEMM runs).
Not counted: the embedding lookup, biases, norms (qk_layernorm's too), activations, softmax,
RoPE, the loss, and the vocabulary padding columns; MoE counts topk experts per token whatever
the capacity drops.
6·L·s·q: attention scores Q·Kᵀ and the weighted sum A·V, 2·s·q FLOPs each per token and layer
over s keys, halved for the causal mask (each query sees s/2 keys on average), ×3 for forward +
backward. This is Megatron's / TorchTitan's 6N + 12·L·h·s per token with the causal halving and
the query width q in place of h.

Multi-head latent attention (model.multi_latent_attention, models/mla.py; n heads, dn =
qk_head_dim, dr = qk_pos_emb_head_dim, dv = v_head_dim, r_q = q_lora_rank, r_kv =
kv_lora_rank): its matmul weights per layer are
    q:  h·r_q + r_q·n·(dn + dr)   (or h·n·(dn + dr) when q_lora_rank is null)
    kv: h·(r_kv + dr) + r_kv·n·(dn + dv)
    o:  n·dv·h
and its attention 3·L·s·n·(dn + dr + dv): scores over dn + dr and the weighted sum over dv,
s·n·(dn + dr) and s·n·dv FLOPs per token and layer after the causal halving, ×3. This is
Megatron-LM's `num_floating_point_operations` (megatron/training/training.py, its
`args.multi_latent_attention` branch) without its norm terms (r_q + r_kv per token, which the
convention here leaves out with every norm).

Light on purpose (config and resolve only): validation and the planner read these.
"""

from __future__ import annotations

from megatron_lite import resolve
from megatron_lite.config import Config, ModelConfig
from megatron_lite.models.registry import FlopsPerToken


def attention_flops(m: ModelConfig) -> tuple[int, int]:
    """(matmul weights, attention FLOPs / seq_length) of one layer's attention, per token: the
    shipped attention's or MLA's (module docstring)."""
    h, n = m.hidden_size, m.num_attention_heads
    if not m.multi_latent_attention:
        d = resolve.kv_channels(m)
        q, kv = n * d, resolve.num_query_groups(m) * d
        return h * (q + 2 * kv) + q * h, 6 * q
    dn, dr, dv, r_kv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
    r_q = m.q_lora_rank
    q = h * n * (dn + dr) if r_q is None else h * r_q + r_q * n * (dn + dr)
    kv = h * (r_kv + dr) + r_kv * n * (dn + dv)
    return q + kv + n * dv * h, 3 * n * (dn + dr + dv)


def decoder_flops(m: ModelConfig, vocab_size: int, gated: bool) -> FlopsPerToken:
    """FLOPs per token of the shipped decoder (module docstring); gated: SwiGLU MLPs."""
    h = m.hidden_size
    mlp_mats = 3 if gated else 2  # SwiGLU: gate, up, down; GeLU: fc1, fc2
    attention, scores = attention_flops(m)
    dense_mlp = mlp_mats * h * resolve.ffn_hidden_size(m)
    n = 0.0
    for layer in range(m.num_layers):
        if resolve.is_moe_layer(m, layer):
            expert = mlp_mats * h * resolve.moe_ffn_hidden_size(m)
            shared = mlp_mats * h * m.moe_shared_expert_ffn_hidden_size  # every token's
            shared += h if m.moe_shared_expert_gate else 0  # its gate's h·1
            n += attention + h * m.num_experts + m.moe_router_topk * expert + shared
        else:
            n += attention + dense_mlp
    return FlopsPerToken(n + h * vocab_size, float(m.num_layers * m.seq_length * scores))


def swiglu_flops(m: ModelConfig, vocab_size: int) -> FlopsPerToken:
    return decoder_flops(m, vocab_size, gated=True)


def gelu_flops(m: ModelConfig, vocab_size: int) -> FlopsPerToken:
    return decoder_flops(m, vocab_size, gated=False)


def check_rotary_head_dim(cfg: Config) -> None:
    """RoPE rotates pairs of dims (i, i + d/2): the head dim must be even."""
    from megatron_lite.validation.rules import _rule  # loaded with validation, its caller

    m = cfg.model
    head_dim = resolve.kv_channels(m)
    key = "model.hidden_size" if m.kv_channels is None else "model.kv_channels"
    _rule(
        head_dim % 2 == 0,
        key,
        m.hidden_size if m.kv_channels is None else m.kv_channels,
        f"gives head dim {head_dim}; rotary embeddings need an even head dim",
        "use hidden_size = an even multiple of num_attention_heads"
        if m.kv_channels is None
        else "use an even model.kv_channels",
    )


MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def check_latent_attention(cfg: Config) -> None:
    """model.multi_latent_attention and its sizes (models/mla.py): MLA's keys only with it on;
    with it on, positive sizes, an even RoPE part, every head its own k/v (no query groups),
    no kv_channels, qk_layernorm or add_qkv_bias (MLA's widths, norms and projections are its
    own); its FP8-aligned local GEMMs are validation/backends.py's rule."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.validation.rules import _rule  # loaded with validation, its caller

    m, default = cfg.model, ModelConfig()
    if not m.multi_latent_attention:
        for key in MLA_KEYS:
            value = getattr(m, key)
            _rule(
                value == getattr(default, key),
                f"model.{key}",
                value,
                "sizes multi-head latent attention, which is off",
                "set model.multi_latent_attention=true, or remove the key",
            )
        return
    for key in MLA_KEYS[1:]:
        _rule(getattr(m, key) >= 1, f"model.{key}", getattr(m, key), "must be >= 1", "use >= 1")
    _rule(
        m.q_lora_rank is None or m.q_lora_rank >= 1,
        "model.q_lora_rank",
        m.q_lora_rank,
        "must be >= 1 or null (no query compression)",
        "use a positive rank, or null",
    )
    _rule(
        m.qk_pos_emb_head_dim % 2 == 0,
        "model.qk_pos_emb_head_dim",
        m.qk_pos_emb_head_dim,
        "RoPE rotates pairs of dims: the decoupled RoPE part must be even",
        "use an even model.qk_pos_emb_head_dim (DeepSeek-V3: 64)",
    )
    n = m.num_attention_heads
    _rule(
        m.num_query_groups in (None, n),
        "model.num_query_groups",
        m.num_query_groups,
        f"multi-head latent attention gives every one of the {n} heads its own key and value",
        "remove model.num_query_groups (or set it to model.num_attention_heads)",
    )
    for key, why in (
        ("kv_channels", "MLA's head widths are qk_head_dim + qk_pos_emb_head_dim and v_head_dim"),
        ("qk_layernorm", "MLA normalizes its compressed q and kv instead (q_a/kv_a_layernorm)"),
        ("add_qkv_bias", "MLA's projections have no biases (DeepSeek-V2/V3)"),
    ):
        value = getattr(m, key)
        _rule(value == getattr(default, key), f"model.{key}", value, why, "remove the key")


def latent_attention_gemm_widths(m: ModelConfig, tp: int) -> dict[str, int]:
    """Every local GEMM dimension of MLA's linears on a TP rank, by what it is (the FP8
    alignment rule of validation/backends.py checks them with the other layers')."""
    n, dn, dr, dv = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    widths = {
        "model.kv_lora_rank + qk_pos_emb_head_dim": m.kv_lora_rank + dr,
        "model.kv_lora_rank": m.kv_lora_rank,
        "heads × (qk_head_dim + qk_pos_emb_head_dim) / tp": n * (dn + dr) // tp,
        "heads × (qk_head_dim + v_head_dim) / tp": n * (dn + dv) // tp,
        "heads × v_head_dim / tp": n * dv // tp,
    }
    if m.q_lora_rank is not None:
        widths["model.q_lora_rank"] = m.q_lora_rank
    return widths


def check_llama(cfg: Config) -> None:
    """The llama entry's rules: RoPE scaling, MLA's sizes, and the even head dim RoPE needs
    (MLA's RoPE part is checked by check_latent_attention)."""
    from megatron_lite.models.rope_scaling import check_rope_scaling

    check_rope_scaling(cfg)
    check_latent_attention(cfg)
    if not cfg.model.multi_latent_attention:
        check_rotary_head_dim(cfg)


def check_no_latent_attention(cfg: Config) -> None:
    """An architecture without MLA (gpt): model.multi_latent_attention must stay false."""
    from megatron_lite.validation.rules import _rule

    m = cfg.model
    _rule(
        not m.multi_latent_attention,
        "model.multi_latent_attention",
        m.multi_latent_attention,
        f"model.arch={m.arch} has no multi-head latent attention (its attention part is "
        "plain multi-head attention)",
        "use model.arch=llama, or set model.multi_latent_attention=false",
    )
    check_latent_attention(cfg)
