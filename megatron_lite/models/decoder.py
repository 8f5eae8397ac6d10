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

Light on purpose (config and resolve only): validation and the planner read these.
"""

from __future__ import annotations

from megatron_lite import resolve
from megatron_lite.config import Config, ModelConfig
from megatron_lite.models.registry import FlopsPerToken


def decoder_flops(m: ModelConfig, vocab_size: int, gated: bool) -> FlopsPerToken:
    """FLOPs per token of the shipped decoder (module docstring); gated: SwiGLU MLPs."""
    h, d = m.hidden_size, resolve.kv_channels(m)
    q, kv = m.num_attention_heads * d, resolve.num_query_groups(m) * d
    mlp_mats = 3 if gated else 2  # SwiGLU: gate, up, down; GeLU: fc1, fc2
    attention = h * (q + 2 * kv) + q * h
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
    return FlopsPerToken(n + h * vocab_size, 6.0 * m.num_layers * m.seq_length * q)


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
