"""Attention backends: torch SDPA (everywhere), flash-attn and Transformer Engine (CUDA only).

Which one runs (`auto` included) is decided by `megatron_lite.resolve.attention_backend`. Every
backend is a callable (q, k, v, dropout_p, docs=None) -> out on [s, b, heads, d] tensors of the
full, ordered sequence (v's head width may differ from q/k's: out takes v's), so the Ulysses
wrapper can run any of them over the context-parallel group. docs [b, s]
(data.reset_attention_mask): each token's document id; attention then stays inside a document
(context/documents.py). TE takes no documents (validation rejects the pair).

Generation (megatron_lite/generate.py) hands the layers a `DecodeContext`: the attention then
writes this step's keys and values into its `KVCache` and attends over all cached positions
with `cached_attention` (torch SDPA whatever the backend: a few query rows per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_lite.context.documents import causal_document_mask
from megatron_lite.models.token_context import TokenContext


def sdpa_attention(q, k, v, dropout_p: float, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention. q [s, b, n, d], k/v [s, b, g, d] (n % g == 0) -> [s, b, n, d]; with
    docs [b, s], within each document only (a boolean mask [b, 1, s, s]).

    A v narrower than q/k (multi-head latent attention) is zero-padded to q's width and the
    output's padding columns dropped (exact): SDPA's flash kernels (CPU and CUDA) take one head
    width, and its math fallback would keep the s×s probabilities for backward."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
        return sdpa_attention(q, k, v, dropout_p, docs)[..., :dv]
    gqa = k.shape[2] != q.shape[2]  # each KV head serves n/g query heads, without copies
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    if docs is None:
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
        )
    else:
        pos = torch.arange(q.shape[2], device=q.device)
        mask = causal_document_mask(pos, pos, docs, docs)  # [b, 1, s, s]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa
        )
    return out.permute(2, 0, 1, 3)


def flash_attention(q, k, v, dropout_p: float, docs: torch.Tensor | None = None) -> torch.Tensor:
    """flash-attn (GQA native). [s, b, heads, d] -> [s, b, n, d]; with docs [b, s] the varlen
    kernel over each row's documents. flash-attn 2 takes one head width for q, k and v: a
    narrower v (multi-head latent attention) is zero-padded to q's width and the output's
    padding columns dropped, which is exact (unverified here: no GPU in CI)."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
        return flash_attention(q, k, v, dropout_p, docs)[..., :dv]
    if docs is not None:
        return _flash_documents(q, k, v, dropout_p, docs)
    from flash_attn import flash_attn_func

    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
    return flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True).transpose(0, 1)


def _flash_documents(q, k, v, dropout_p: float, docs: torch.Tensor) -> torch.Tensor:
    """Each document of each row as its own causal sequence of flash_attn_varlen_func.
    Unverified here (CPU only, no flash-attn): the GPU tests are its check."""
    from flash_attn import flash_attn_varlen_func

    s, b = q.shape[:2]
    # [b, s] -> [b·s] ids unique across rows (rows never merge), cut where the id changes
    flat = (docs + torch.arange(b, device=docs.device)[:, None] * s).reshape(-1)
    lengths = torch.unique_consecutive(flat, return_counts=True)[1]
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [documents + 1]
    longest = int(lengths.max())
    q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v))  # [b·s, h, d]
    out = flash_attn_varlen_func(
        q, k, v, cu, cu, longest, longest, dropout_p=dropout_p, causal=True
    )  # [b·s, n, d]
    return out.view(b, s, *out.shape[1:]).transpose(0, 1)


class TEAttention(torch.nn.Module):
    """Transformer Engine DotProductAttention on [s, b, heads, d] tensors."""

    def __init__(self, n_local: int, g_local: int, head_dims: tuple[int, int], dropout_p: float):
        super().__init__()
        import transformer_engine.pytorch as te

        qk, v = head_dims
        self.n = n_local
        self.attn = te.DotProductAttention(
            n_local,
            qk if qk == v else (qk, v),  # TE's kv_channels: one width, or (q/k, v)
            num_gqa_groups=g_local,
            attention_dropout=dropout_p,
            qkv_format="sbhd",
            attn_mask_type="causal",
        )

    def forward(self, q, k, v, dropout_p: float, docs: torch.Tensor | None = None) -> torch.Tensor:
        if docs is not None:
            raise ValueError(
                "model.attention_backend=te takes no per-document mask "
                "(data.reset_attention_mask). Fix: use model.attention_backend=sdpa or flash"
            )
        q, k, v = (t.contiguous() for t in (q, k, v))  # Ulysses hands over head-sliced views
        out = self.attn(q, k, v)  # [s, b, n·d]
        return out.view(*q.shape[:2], self.n, -1)


def attention_function(
    backend: str, n_local: int, g_local: int, head_dims: tuple[int, int], dropout_p: float
):
    """A callable (q, k, v, dropout_p, docs=None) -> out for `backend` (already resolved);
    head_dims: the (q/k, v) widths of each head."""
    if backend == "flash":
        return flash_attention
    if backend == "te":
        return TEAttention(n_local, g_local, head_dims, dropout_p)
    return sdpa_attention


class KVCache:
    """Keys and values of every attention layer during generation: per layer [L, b, g, d] k
    and [L, b, g, dv] v (this TP rank's KV heads; L = max_length, the longest sequence the
    generation reaches), filled by the prompt's forward, then one position per step.
    `length` positions are filled in every layer; `advance(s)` after each forward."""

    def __init__(self, max_length: int):
        self.max_length, self.length = max_length, 0
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(attention) -> k, v

    def extend(self, owner: torch.nn.Module, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [s, b, heads, d] at positions length..length+s of `owner`'s cache (made
        on first use); returns its k, v [length + s, b, heads, d] (views)."""
        end = self.length + k.shape[0]
        if end > self.max_length:
            raise ValueError(f"KVCache: position {end} is past max_length={self.max_length}")
        if id(owner) not in self._layers:
            self._layers[id(owner)] = tuple(
                t.new_empty((self.max_length, *t.shape[1:])) for t in (k, v)
            )
        ck, cv = self._layers[id(owner)]
        ck[self.length : end], cv[self.length : end] = k, v
        return ck[:end], cv[:end]

    def advance(self, s: int) -> None:
        self.length += s


@dataclass(frozen=True)
class DecodeContext(TokenContext):
    """A `TokenContext` for one generation step: rope [s, b, r] at each row's positions,
    positions [s, b] (learned position tables), the cache, and mask [b, 1, s, length + s]
    (True: the query may attend to that cached position)."""

    kv_cache: KVCache | None = None
    mask: torch.Tensor | None = None


def cached_attention(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """q [s, b, n, d] over the cached k/v [L, b, g, d] (n % g == 0) where mask [b, 1, s, L]
    allows -> [s, b, n, dv]."""
    gqa = k.shape[2] != q.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s or L, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3)
