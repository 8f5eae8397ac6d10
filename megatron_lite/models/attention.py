"""Attention backends: torch SDPA (everywhere), flash-attn and Transformer Engine (CUDA only).

Which one runs (`auto` included) is decided by `megatron_lite.resolve.attention_backend`. Every
backend is a callable (q, k, v, dropout_p) -> out on [s, b, heads, d] tensors, so the Ulysses
wrapper can run any of them over the context-parallel group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_attention(q, k, v, dropout_p: float) -> torch.Tensor:
    """Causal attention. q [s, b, n, d], k/v [s, b, g, d] (n % g == 0) -> [s, b, n, d]."""
    gqa = k.shape[2] != q.shape[2]  # each KV head serves n/g query heads, without copies
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
    )
    return out.permute(2, 0, 1, 3)


def flash_attention(q, k, v, dropout_p: float) -> torch.Tensor:
    """flash-attn (GQA native). [s, b, heads, d] -> [s, b, n, d]."""
    from flash_attn import flash_attn_func

    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
    return flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True).transpose(0, 1)


class TEAttention(torch.nn.Module):
    """Transformer Engine DotProductAttention on [s, b, heads, d] tensors."""

    def __init__(self, n_local: int, g_local: int, head_dim: int, dropout_p: float):
        super().__init__()
        import transformer_engine.pytorch as te

        self.n = n_local
        self.attn = te.DotProductAttention(
            n_local,
            head_dim,
            num_gqa_groups=g_local,
            attention_dropout=dropout_p,
            qkv_format="sbhd",
            attn_mask_type="causal",
        )

    def forward(self, q, k, v, dropout_p: float) -> torch.Tensor:
        q, k, v = (t.contiguous() for t in (q, k, v))  # Ulysses hands over head-sliced views
        out = self.attn(q, k, v)  # [s, b, n·d]
        return out.view(*q.shape[:2], self.n, -1)


def attention_function(backend: str, n_local: int, g_local: int, head_dim: int, dropout_p: float):
    """A callable (q, k, v, dropout_p) -> out for `backend` (already resolved)."""
    if backend == "flash":
        return flash_attention
    if backend == "te":
        return TEAttention(n_local, g_local, head_dim, dropout_p)
    return sdpa_attention
