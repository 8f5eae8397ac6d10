"""Model FLOPs per token (local stand-in for megatron_lite.training.flops until it lands).

Convention (Megatron, TorchTitan): a training step costs 3 forward passes (forward + backward of
activations and weights), a forward costs 2 FLOPs per multiply-accumulate, so per token
6 · (parameters used by the matmuls, the output layer included, the embedding lookup excluded)
plus the attention scores and values: 2 matmuls of s·(n·d) per token per layer in the forward,
halved by the causal mask, i.e. 6 · L · s · n·d per token for the step. MoE counts the top-k
experts a token visits.
"""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.plan.hardware import get_gpu
from megatron_lite.resolve import (
    ffn_hidden_size,
    moe_ffn_hidden_size,
    num_moe_layers,
    num_query_groups,
    padded_vocab_size,
)


def layer_matmul_params(cfg: Config, moe: bool = False) -> int:
    """Weights of one layer's matmuls a token passes through (MoE: router + top-k experts)."""
    m = cfg.model
    h, n = m.hidden_size, m.num_attention_heads
    d, g = h // n, num_query_groups(m)
    attn = h * (n + 2 * g) * d + n * d * h
    gated = 3 if m.arch == "llama" else 2
    if moe:
        f = moe_ffn_hidden_size(m)
        return attn + h * m.num_experts + m.moe_router_topk * gated * h * f
    return attn + gated * h * ffn_hidden_size(m)


def model_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token of the whole model (see the module docstring)."""
    m = cfg.model
    moe = num_moe_layers(m)
    matmul = (m.num_layers - moe) * layer_matmul_params(cfg)
    if moe:
        matmul += moe * layer_matmul_params(cfg, True)
    matmul += m.hidden_size * padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    attention = m.num_layers * m.seq_length * m.hidden_size  # n·d = h
    return 6.0 * (matmul + attention)


def peak_tflops(gpu: str) -> float:
    """Peak dense bf16 TFLOP/s of a GPU type (plan/hardware.py)."""
    return get_gpu(gpu).peak_tflops
