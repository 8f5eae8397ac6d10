"""DeepSpeed-Ulysses attention over the context-parallel (CP) group (`parallel.cp_comm_type: a2a`).

Each CP rank holds a contiguous sequence slice. One all-to-all turns q, k and v, packed along
the heads, from [s/cp, b, heads, d] into [s, b, heads/cp, d] (whole sequences, a subset of
heads), any local attention runs on that, and the conjugate all-to-all restores the sequence
split of its output: two all-to-alls per layer forward, two backward. The backward of each
all-to-all is the all-to-all with split and concat dims swapped (see parallel/mappings.py).

Per layer and rank the forward moves s·b·(n·dk + g·(dk + dv) + n·dv)/(tp·cp) elements (q, k,
v, out; dk and dv the q/k and v head widths, which the attention part declares and may differ,
as in multi-head latent attention; g counted after replication up to cp): (2 + 2·g/n)·s·b·h /
(tp·cp) when dk = dv = h/n. Of it (cp−1)/cp leaves the rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_lite.parallel import mappings


def ulysses_kv_heads(g: int, cp: int) -> int:
    """KV heads that enter the all-to-all from g per rank: replicated up to cp when g < cp
    (every CP rank then gets whole KV groups for its query heads), so each CP rank attends with
    `ulysses_kv_heads(g, cp) // cp` of them. g must divide or be divisible by cp."""
    if g < cp:
        if cp % g:
            raise ValueError(
                f"Ulysses: {g} KV heads per rank neither divide nor are divisible by cp={cp}"
            )
        return cp
    if g % cp:
        raise ValueError(f"Ulysses: {g} KV heads per rank not divisible by cp={cp}")
    return g


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group,
    attn_fn: Callable,
    docs: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [s/cp, b, n, dk], k [s/cp, b, g, dk], v [s/cp, b, g, dv] -> [s/cp, b, n, dv], with
    `attn_fn(q, k, v)` computing causal attention on [s, b, heads, d] tensors (the head widths
    are read from the tensors: dv may differ from dk). docs [b, s]: the document ids of
    the full sequence (every rank holds the whole sample), handed on as `attn_fn(q, k, v,
    docs=docs)` so attention stays inside documents; None: `attn_fn(q, k, v)`.

    When g < cp the KV heads are replicated up to cp so every rank gets whole KV groups for
    its query heads (g must divide cp; n must be divisible by cp).
    """
    cp = mappings.size(cp_group)
    n, g = q.shape[2], k.shape[2]
    if n % cp:
        raise ValueError(f"Ulysses: {n} query heads per rank not divisible by cp={cp}")
    g_total = ulysses_kv_heads(g, cp)
    if g_total > g:
        k, v = k.repeat_interleave(g_total // g, dim=2), v.repeat_interleave(g_total // g, dim=2)
    # one all-to-all for q, k and v: lay out each rank's share of the heads as one row
    # [cp, (n·dk + g·dk + g·dv)/cp] so that row r holds rank r's query, key and value heads,
    # then [s/cp, b, cp, ·] -> [s, b, 1, ·] (whole sequences, heads/cp of each)
    s_local, b, g = k.shape[:3]
    dk, dv = q.shape[3], v.shape[3]
    qkv = torch.cat([t.reshape(s_local, b, cp, -1) for t in (q, k, v)], dim=3)
    qkv = mappings.all_to_all(qkv, split_dim=2, concat_dim=0, group=cp_group)  # [s, b, 1, ·]
    widths = [n // cp * dk, g // cp * dk, g // cp * dv]
    q, k, v = (
        t.view(*t.shape[:2], -1, d)
        for t, d in zip(qkv.flatten(2).split(widths, dim=2), (dk, dk, dv), strict=True)
    )
    out = attn_fn(q, k, v) if docs is None else attn_fn(q, k, v, docs=docs)  # [s, b, n/cp, dv]
    return mappings.all_to_all(out, split_dim=0, concat_dim=2, group=cp_group)  # [s/cp, b, n, dv]
