"""Ring attention over a context-parallel ring (`parallel.cp_comm_type: p2p`, and the ring part
of `a2a+p2p`).

Each of the R ring ranks holds q, k and v of its own tokens (context/layout.py: chunks j and
2R−1−j of 2R under causal load balancing). K and V travel around the ring in R−1 steps: at each
step a rank posts the send of the block it holds to the next rank and the receive of the
previous rank's, then attends its queries to the block it holds while they are in flight. The
partial results merge by log-sum-exp in fp32 (fp64 for fp64 inputs). The backward circulates K
and V again; the dK/dV of each block travel with it and reach its owner one step after the last.

Work is cut into sub-blocks (a chunk of queries against a chunk of keys, each cut into runs of
at most `tile_size` tokens so the fp32 scores stay bounded) decided from the positions alone:
skipped when every key follows every query, unmasked when every key precedes every query, causally
masked otherwise (the diagonal). With documents (doc ids of the whole [b, s] sample) the mask
also requires the same document, and a sub-block where no row shares a document is skipped.
With balancing every rank computes 2R+1 chunk² of sub-blocks, two of them the masked
diagonal: equal work on every rank.

Per layer and rank the forward sends (R−1) K/V blocks of s_r·b·g·(dk + dv) elements (s_r this
rank's tokens, g KV heads, dk and dv the key and value head widths, read from the tensors: the
attention part declares them and they may differ), the backward R−1 K/V blocks and R dK/dV
blocks (in fp32: the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.context.documents import causal_document_mask
from megatron_lite.context.layout import Ranges
from megatron_lite.parallel import host, mappings


@dataclass(frozen=True)
class Block:
    """Queries at global positions [qs, qe) (local rows `q`) against keys at [ks, ke) (rows `k`
    of the K/V block held at that step); `causal`: some key follows some query, so the causal
    mask applies; `docs`: the document mask applies. Masks are built when used (forward and
    backward), never kept: they are chunk² in size."""

    q: slice
    k: slice
    span: tuple[int, int, int, int]  # qs, qe, ks, ke
    causal: bool
    docs: torch.Tensor | None

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """bool [b or 1, 1, 1, sq, sk] (True: attend), or None (attend to all)."""
        if not self.causal and self.docs is None:
            return None
        qs, qe, ks, ke = self.span
        q_pos, k_pos = torch.arange(qs, qe, device=device), torch.arange(ks, ke, device=device)
        q_doc = k_doc = None
        if self.docs is not None:
            q_doc, k_doc = self.docs[:, qs:qe], self.docs[:, ks:ke]
        return causal_document_mask(q_pos, k_pos, q_doc, k_doc)[:, None]  # [b|1, 1, 1, sq, sk]


# a sub-block's fp32 scores (b·heads·tile², three of them in backward) stay under this,
# however long the chunks are: tile_size picks the longest query/key run that fits
SCORE_BYTES = 2**30


def tile_size(batch: int, heads: int) -> int:
    """The longest run of queries or keys in one sub-block: the largest power of two (at least
    128) whose fp32 scores b·heads·tile²·4 fit in SCORE_BYTES."""
    tile = 128
    while batch * heads * (2 * tile) ** 2 * 4 <= SCORE_BYTES:
        tile *= 2
    return tile


def _segments(ranges: Ranges, tile: int) -> list[tuple[slice, int, int]]:
    """(local rows, first position, end position) of each range, cut into runs of <= tile."""
    out, row = [], 0
    for s, e in ranges:
        for a in range(s, e, tile):
            b = min(a + tile, e)
            out.append((slice(row, row + b - a), a, b))
            row += b - a
    return out


def _doc_bounds(all_ranges: list[Ranges], docs: torch.Tensor | None, tile: int):
    """{(start, end): ([first doc per row], [last doc per row])} for every segment of every
    ring rank, read to the host once; None without documents. A dry run assumes one document."""
    if docs is None:
        return None
    ends = sorted({(a, b) for ranges in all_ranges for _, a, b in _segments(ranges, tile)})
    idx = torch.tensor([i for s, e in ends for i in (s, e - 1)], device=docs.device)
    vals = host.read(docs[:, idx].t(), lambda: [[0] * docs.shape[0]] * len(idx))
    return {r: (vals[2 * i], vals[2 * i + 1]) for i, r in enumerate(ends)}


def _shares_document(bounds, q_range, k_range) -> bool:
    (q_lo, q_hi), (k_lo, k_hi) = bounds[q_range], bounds[k_range]
    return any(max(a, c) <= min(b, d) for a, b, c, d in zip(q_lo, q_hi, k_lo, k_hi, strict=True))


def plan_blocks(
    q_ranges: Ranges,
    k_ranges: Ranges,
    docs: torch.Tensor | None = None,
    bounds=None,
    tile: int = 2**62,
) -> list[Block]:
    """The sub-blocks (runs of <= tile queries at `q_ranges` against <= tile keys at
    `k_ranges`: global positions, local order) that have any (q, k) pair to attend. `docs`
    [b, s]: doc ids of the whole sample (None: no document masking); `bounds` from
    `_doc_bounds` with the same tile."""
    blocks = []
    for q_rows, qs, qe in _segments(q_ranges, tile):
        for k_rows, ks, ke in _segments(k_ranges, tile):
            if ks >= qe:  # every key after every query
                continue
            if docs is not None and not _shares_document(bounds, (qs, qe), (ks, ke)):
                continue
            blocks.append(Block(q_rows, k_rows, (qs, qe, ks, ke), ke > qs + 1, docs))
    return blocks


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that attend nothing) replaced by 0, so exp(s - lse) is 0 there."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, g, n/g, sq, sk]
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(q, k, v, mask, scale):
    """Attention of q [b, g, n/g, sq, dk] to k [b, g, 1, sk, dk], v [b, g, 1, sk, dv]: (out
    [b, g, n/g, sq, dv], lse [b, g, n/g, sq]).
    One exp pass: e = exp(s - rowmax), out = e·v / Σe, lse = rowmax + log Σe."""
    s = _scores(q, k, mask, scale)
    m = _finite(s.amax(dim=-1, keepdim=True))
    e = s.sub_(m).exp_()
    total = e.sum(dim=-1, keepdim=True)  # 0 where a row attends nothing here
    out = torch.matmul(e, v) / torch.where(total == 0, torch.ones_like(total), total)
    return out, (m + total.log()).squeeze(-1)


def _block_backward(q, k, v, do, lse, delta, mask, scale):
    """Gradients of one sub-block given the final lse and delta = rowsum(dO·O)."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse)[..., None])  # [b, g, n/g, sq, sk]
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # [b, g, sk, d]
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, k) * scale  # [b, g, n/g, sq, d]
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale  # [b, g, sk, d]
    return dq, dk, dv


def _merge(out, lse, rows: slice, o, l_) -> None:
    """Fold a sub-block's (o, l_) into the running (out, lse) of query rows `rows`."""
    old = lse[..., rows]
    new = torch.logaddexp(old, l_)
    safe = _finite(new)
    out[..., rows, :] = (
        out[..., rows, :] * torch.exp(old - safe)[..., None] + o * torch.exp(l_ - safe)[..., None]
    )
    lse[..., rows] = new


def _q_heads(t: torch.Tensor, g: int, dtype) -> torch.Tensor:
    s, b, n, d = t.shape  # [s, b, n, d] -> [b, g, n/g, s, d] (query head i uses KV head i·g/n)
    return t.to(dtype).permute(1, 2, 0, 3).reshape(b, g, n // g, s, d)


def _kv_heads(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype).permute(1, 2, 0, 3).unsqueeze(2)  # [s, b, g, d] -> [b, g, 1, s, d]


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k [s, b, g, dk], v [s, b, g, dv] -> one message [s, b, g·(dk + dv)] (K's heads first)."""
    return torch.cat([k.flatten(2), v.flatten(2)], dim=2)


def _unpack(kv: torch.Tensor, g: int, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `_pack`: views k [s, b, g, dk], v [s, b, g, dv]."""
    k, v = kv.split([g * dk, g * dv], dim=2)
    return k.unflatten(2, (g, dk)), v.unflatten(2, (g, dv))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, all_ranges, docs, scale, tile):
        R, r, g = mappings.size(group), mappings.group_rank(group), k.shape[2]
        dk, dv = k.shape[3], v.shape[3]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        bounds = _doc_bounds(all_ranges, docs, tile)
        plans = [
            plan_blocks(all_ranges[r], all_ranges[(r - i) % R], docs, bounds, tile)
            for i in range(R)
        ]
        qh = _q_heads(q, g, cdt)
        # [b, g, n/g, s_r, dv] laid out as [s_r, b, n, dv], as q is: the output is then a view
        out = _q_heads(q.new_zeros(*q.shape[:3], dv, dtype=cdt), g, cdt)
        lse = torch.full(qh.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        kv = _pack(k, v)  # [s_r, b, g·(dk + dv)]: one message per step
        for i in range(R):
            shift = mappings.ring_shift(kv, group) if i < R - 1 else None
            kh, vh = (_kv_heads(t, cdt) for t in _unpack(kv, g, dk, dv))
            for blk in plans[i]:
                o, l_ = block_forward(qh[..., blk.q, :], kh[..., blk.k, :], vh[..., blk.k, :],
                                      blk.mask(q.device), scale)  # fmt: skip
                _merge(out, lse, blk.q, o, l_)
            if shift is not None:
                kv = shift.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.scale = group, plans, scale
        s, b, n = q.shape[:3]
        return out.reshape(b, n, s, dv).permute(2, 0, 1, 3).to(q.dtype)  # [s, b, n, dv]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, plans, scale = ctx.group, ctx.plans, ctx.scale
        R, g, cdt = mappings.size(group), k.shape[2], out.dtype
        dk_, dv_ = k.shape[3], v.shape[3]
        qh, do = _q_heads(q, g, cdt), _q_heads(grad_out, g, cdt)
        delta = (do * out).sum(-1)  # [b, g, n/g, sq]
        dq = torch.zeros_like(qh)
        kv = _pack(k, v)
        dkv_shift = None
        for i in range(R):
            kv_shift = mappings.ring_shift(kv, group) if i < R - 1 else None
            kh, vh = (_kv_heads(t, cdt) for t in _unpack(kv, g, dk_, dv_))
            dk, dv = torch.zeros_like(kh[:, :, 0]), torch.zeros_like(vh[:, :, 0])  # [b, g, s, d]
            for blk in plans[i]:
                dq_b, dk_b, dv_b = _block_backward(
                    qh[..., blk.q, :], kh[..., blk.k, :], vh[..., blk.k, :], do[..., blk.q, :],
                    lse[..., blk.q], delta[..., blk.q], blk.mask(q.device), scale,
                )  # fmt: skip
                dq[..., blk.q, :] += dq_b
                dk[..., blk.k, :] += dk_b
                dv[..., blk.k, :] += dv_b
            dkv = _pack(dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3))  # [s_r, b, g·(dk + dv)]
            if dkv_shift is not None:  # the previous ranks' share of this block's gradient
                dkv = dkv + dkv_shift.wait()
            dkv_shift = mappings.ring_shift(dkv.contiguous(), group) if R > 1 else None
            if kv_shift is not None:
                kv = kv_shift.wait()
        dkv = dkv_shift.wait() if dkv_shift is not None else dkv  # our own block, complete
        s, b, n, d = q.shape
        dq = dq.reshape(b, n, s, d).permute(2, 0, 1, 3).to(q.dtype)
        dk, dv = _unpack(dkv.to(k.dtype), g, dk_, dv_)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring_group,
    all_ranges: list[Ranges],
    docs: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Causal attention of this ring rank's q [s_r, b, n, dk] over the whole ring's k
    [s_r, b, g, dk] and v [s_r, b, g, dv] (n % g == 0; dv may differ from dk) -> [s_r, b, n, dv].

    `all_ranges[j]`: the global positions of ring rank j's tokens, in local order
    (layout.ring_ranges); `docs` [b, s]: doc ids of the whole sample for document masking;
    `tile`: the longest query/key run of one sub-block (None: `tile_size`).
    """
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    n_tokens = sum(e - s for s, e in all_ranges[mappings.group_rank(ring_group)])
    fits = k.shape[:3] == v.shape[:3] and q.shape[3] == k.shape[3] and q.shape[:2] == k.shape[:2]
    if q.shape[0] != n_tokens or not fits or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
            f"fit {n_tokens} local tokens with KV heads dividing query heads (q and k of one "
            "head width, k and v of the same tokens and heads)"
        )
    tile = tile or tile_size(q.shape[1], q.shape[2])
    return _RingAttention.apply(q, k, v, ring_group, all_ranges, docs, scale, tile)
