"""Model FLOPs (the MFU convention) and peak dense bf16 throughput per GPU type.

Pure functions of the config, shared by the trainer's progress line and the planner.

Per token, forward + backward = 3 × the forward's matmul FLOPs (backward: one GEMM for the input
gradient and one for the weight gradient per forward GEMM), a multiply-add counted as 2 FLOPs:

    6·N_active + 6·L·s·q

N_active: the weights every token multiplies, i.e. per layer the attention projections
h·(q + 2·kv) + q·h (q = heads·head_dim, kv = query_groups·head_dim with head_dim =
model.kv_channels, so q may differ from h; grouped-query attention at its real width), the dense
MLP (3·h·ffn with SwiGLU, 2·h·ffn with GeLU) or for a MoE layer the router h·E plus topk experts'
MLPs, and the output layer h·V (V the unpadded vocabulary; counted when tied too, its GEMM runs).
Not counted: the embedding lookup, biases, norms (qk_layernorm's too), activations, softmax,
RoPE, the loss, and the vocabulary padding columns; MoE counts topk experts per token whatever
the capacity drops.
6·L·s·q: attention scores Q·Kᵀ and the weighted sum A·V, 2·s·q FLOPs each per token and layer
over s keys, halved for the causal mask (each query sees s/2 keys on average), ×3 for forward +
backward. This is Megatron's / TorchTitan's 6N + 12·L·h·s per token with the causal halving and
the query width q in place of h.
"""

from __future__ import annotations

from megatron_lite import resolve
from megatron_lite.config import Config
from megatron_lite.models.transformer_config import SPECS

# Peak dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s per GPU, from NVIDIA's datasheets.
PEAK_BF16_TFLOPS = {
    "h100": 989.0,  # H100 SXM
    "h100-pcie": 756.0,
    "h200": 989.0,  # H200 SXM: the H100's compute with more memory
    "a100": 312.0,
    "b200": 2250.0,
}


def matmul_params_per_token(cfg: Config, vocab_size: int | None = None) -> float:
    """N_active: weights each token multiplies in one forward (see the module docstring).
    `vocab_size` stands in for a null model.vocab_size (the tokenizer's)."""
    m = cfg.model
    v = vocab_size if m.vocab_size is None else m.vocab_size
    if v is None:
        raise ValueError("model.vocab_size is null: pass the tokenizer's vocab_size")
    h, d = m.hidden_size, resolve.kv_channels(m)
    q, kv = m.num_attention_heads * d, resolve.num_query_groups(m) * d
    mlp_mats = 3 if SPECS[m.arch].gated_mlp else 2  # SwiGLU: gate, up, down; GeLU: fc1, fc2
    attention = h * (q + 2 * kv) + q * h
    dense_mlp = mlp_mats * h * resolve.ffn_hidden_size(m)
    n = 0.0
    for layer in range(m.num_layers):
        if resolve.is_moe_layer(m, layer):
            expert = mlp_mats * h * resolve.moe_ffn_hidden_size(m)
            shared = mlp_mats * h * m.moe_shared_expert_ffn_hidden_size  # every token's
            n += attention + h * m.num_experts + m.moe_router_topk * expert + shared
        else:
            n += attention + dense_mlp
    return n + h * v


def model_flops_per_token(cfg: Config, vocab_size: int | None = None) -> float:
    """Model FLOPs of forward + backward per token: 6·N_active + 6·L·s·q."""
    m = cfg.model
    q = m.num_attention_heads * resolve.kv_channels(m)
    attention = 6.0 * m.num_layers * m.seq_length * q
    return 6.0 * matmul_params_per_token(cfg, vocab_size) + attention


def peak_tflops(gpu: str) -> float:
    """Peak dense bf16 TFLOP/s of a GPU: a key of PEAK_BF16_TFLOPS ("h100", "b200", ...) or a
    device name as torch.cuda.get_device_name gives it ("NVIDIA H100 80GB HBM3")."""
    name = gpu.lower()
    for key in ("h100", "h200", "a100", "b200"):
        if key in name:
            return PEAK_BF16_TFLOPS["h100-pcie" if key == "h100" and "pcie" in name else key]
    raise ValueError(
        f"unknown GPU {gpu!r}: peak bf16 TFLOP/s known for {', '.join(PEAK_BF16_TFLOPS)}"
    )
