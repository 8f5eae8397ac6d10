"""Per-token cross-entropy over a (possibly tensor-parallel) vocabulary, never materializing
the softmax: Triton kernels + torch reference.

    loss[i] = logsumexp(logits[i, :]) - logits[i, target[i]]       (0 where target == ignore)

logits: [N, V_local] (any leading shape works; it is flattened), target: [N] global vocabulary
ids. This file is leaf code (no collectives): `cross_entropy` is the whole-vocabulary loss, and
`shard_stats` / `global_lse` / `logits_grad` are the per-shard pieces from which
`megatron_lite.parallel.cross_entropy` builds the vocab-parallel loss. A shard holds ids
[vocab_start, vocab_start + V_local) and reduces to three numbers per token (max, sum of exp
relative to that max, target logit if local); dlogits = (softmax - onehot) · dloss is written
blockwise in the logits dtype and needs only the global log-sum-exp.

Logits may hold -inf (padded vocabulary entries masked by the caller): they contribute exp = 0,
and a shard or block that is entirely -inf is handled without NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_lite.kernels import selfcheck
from megatron_lite.kernels.dispatch import (
    as_rows,
    compute_dtype,
    launch,
    num_warps_for,
    use_triton,
)

IGNORE_INDEX = -100  # targets that get loss 0 and no gradient (padding), as in torch
BLOCK_V = 4096  # vocab chunk per loop step (tests shrink it to exercise the online softmax)


@triton.jit
def _ce_fwd_kernel(
    LOGITS, TARGET, MAX, SUMEXP, TGT_LOGIT, stride_l, n_vocab, vocab_start, ignore_index,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    m = float("-inf")
    s = 0.0
    for start in range(0, n_vocab, BLOCK_V):  # online max / sum-exp, one pass over the row
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf) = 0
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    target = tl.load(TARGET + row)
    local = target - vocab_start
    is_local = (local >= 0) & (local < n_vocab) & (target != ignore_index)
    t_logit = tl.load(base + local, mask=is_local, other=0.0).to(tl.float32)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TGT_LOGIT + row, t_logit)


@triton.jit
def _ce_bwd_kernel(
    LOGITS, TARGET, LSE, DLOSS, DLOGITS, stride_l, stride_dloss, stride_d, n_vocab,
    vocab_start, ignore_index, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGET + row)
    local = target - vocab_start
    ignored = target == ignore_index
    lse = tl.load(LSE + row)
    dloss = tl.load(DLOSS + row * stride_dloss).to(tl.float32)
    for start in range(0, n_vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_vocab
        x = tl.load(LOGITS + row * stride_l + cols, mask=mask, other=float("-inf"))
        p = tl.exp(x.to(tl.float32) - lse)
        p = tl.where(cols == local, p - 1.0, p)
        d = tl.where(ignored, 0.0, p * dloss)  # where, not ·0: lse of an ignored row may be inf
        tl.store(DLOGITS + row * stride_d + cols, d.to(DLOGITS.dtype.element_ty), mask=mask)


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """Row maxima with -inf (an all-masked row or shard) replaced by 0, so exp(x - m) stays 0."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def global_lse(row_max: torch.Tensor, sumexp: torch.Tensor) -> torch.Tensor:
    """log Σ exp from the (global) row max and the sum of exp relative to it."""
    return safe_max(row_max) + torch.log(sumexp)


def _shard_stats_torch(logits, target, vocab_start, ignore_index):
    """Torch version of the forward kernel: per-row max, sum-exp, local target logit."""
    x = logits.to(compute_dtype(logits.dtype))
    n_vocab = x.shape[-1]
    m = x.max(dim=-1).values
    s = torch.exp(x - safe_max(m)[:, None]).sum(-1)
    local = target - vocab_start
    is_local = (local >= 0) & (local < n_vocab) & (target != ignore_index)
    t_logit = x.gather(1, local.clamp(0, n_vocab - 1)[:, None]).squeeze(1)
    return m, s, torch.where(is_local, t_logit, torch.zeros_like(t_logit))


def _grad_torch(logits, target, lse, dloss, vocab_start, ignore_index):
    """Torch version of the backward kernel: (softmax - onehot) · dloss, logits dtype."""
    p = torch.exp(logits.to(lse.dtype) - lse[:, None])
    local = target - vocab_start
    is_local = (local >= 0) & (local < logits.shape[-1]) & (target != ignore_index)
    # onehot: -1 at the target's column of rows whose target is local (adding -0.0 elsewhere
    # changes nothing); masked in place, no data-dependent shapes (a dry run's fake tensors)
    col = local.clamp(0, logits.shape[-1] - 1)[:, None]
    p.scatter_add_(1, col, -is_local[:, None].to(p.dtype))
    d = p * dloss.to(p.dtype)[:, None]
    d.masked_fill_((target == ignore_index)[:, None], 0.0)
    return d.to(logits.dtype)


def _self_check(device: torch.device, dtype: torch.dtype, shape_class) -> None:
    """Both kernels vs their torch versions on a vocabulary shard of this width (selfcheck.py):
    targets inside, at the start of, below and above the shard, one ignored, and a row with a
    padded (-inf) tail. The forward is compared as what the loss reads: log-sum-exp, target
    logit."""
    n_vocab, start = shape_class, 7  # a shard that does not begin at id 0
    gen = selfcheck.generator(device)
    logits = selfcheck.sample((6, n_vocab), dtype, device, gen, requires_grad=False, scale=4)
    logits[5, max(n_vocab // 2, 1) :] = float("-inf")
    target = torch.randint(start, start + n_vocab, (6,), generator=gen, device=device)
    target[1:6] = torch.tensor([start, start - 1, start + n_vocab, IGNORE_INDEX, start])
    got = _stats_triton(logits, target, start, IGNORE_INDEX)
    want = _shard_stats_torch(logits, target, start, IGNORE_INDEX)
    lse = global_lse(want[0], want[1])
    selfcheck.compare("log-sum-exp", global_lse(got[0], got[1]), lse, dtype)
    selfcheck.compare("target logit", got[2], want[2], dtype)
    dloss = selfcheck.sample((6,), torch.float32, device, gen, requires_grad=False)
    got = _grad_triton(logits, target, lse, dloss, start, IGNORE_INDEX)
    want = _grad_torch(logits, target, lse, dloss, start, IGNORE_INDEX)
    selfcheck.compare("logits gradient", got, want, dtype)


def use_triton_path(logits: torch.Tensor, target: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors once they passed their self-check (or when forced), the
    torch path otherwise."""
    n_vocab = logits.shape[-1]
    return target.numel() > 0 and use_triton(logits, "cross_entropy", n_vocab, _self_check)


def shard_stats(logits, target, vocab_start: int, ignore_index: int, triton_path: bool):
    """logits [N, V_local], target [N] -> per-row (max, sum-exp relative to it, target logit
    where the target lies in this shard, else 0), each [N] fp32 (fp64 for fp64 logits)."""
    if triton_path:
        return _stats_triton(logits, target, vocab_start, ignore_index)
    return _shard_stats_torch(logits, target, vocab_start, ignore_index)


def logits_grad(logits, target, lse, dloss, vocab_start: int, ignore_index: int, triton_path):
    """d(loss)/d(logits) [N, V_local] in the logits dtype, from the global log-sum-exp [N]."""
    if triton_path:
        return _grad_triton(logits, target, lse, dloss, vocab_start, ignore_index)
    return _grad_torch(logits, target, lse, dloss, vocab_start, ignore_index)


class CrossEntropyFunction(torch.autograd.Function):
    """Per-token cross-entropy over a whole (local) vocabulary."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, triton_path):
        stats = shard_stats(logits, target, 0, ignore_index, triton_path)
        lse, target_logit = global_lse(stats[0], stats[1]), stats[2]
        loss = torch.where(target == ignore_index, torch.zeros_like(lse), lse - target_logit)
        ctx.save_for_backward(logits, target, lse)
        ctx.meta = (ignore_index, triton_path)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse = ctx.saved_tensors
        ignore_index, triton_path = ctx.meta
        dlogits = logits_grad(logits, target, lse, dloss, 0, ignore_index, triton_path)
        return dlogits, None, None, None


def _block_v(n_vocab: int) -> int:
    return min(triton.next_power_of_2(n_vocab), BLOCK_V)


def _stats_triton(logits, target, vocab_start, ignore_index):
    n, n_vocab = logits.shape
    m, s, t = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    block = _block_v(n_vocab)
    launch(_ce_fwd_kernel, (n,),
        logits, target, m, s, t, logits.stride(0), n_vocab, vocab_start, ignore_index,
        BLOCK_V=block, num_warps=num_warps_for(block),
    )  # fmt: skip
    return m, s, t


def _grad_triton(logits, target, lse, dloss, vocab_start, ignore_index):
    n, n_vocab = logits.shape
    dlogits = torch.empty_like(logits)
    block = _block_v(n_vocab)
    launch(_ce_bwd_kernel, (n,),
        logits, target, lse, dloss, dlogits, logits.stride(0), dloss.stride(0),
        dlogits.stride(0), n_vocab, vocab_start, ignore_index,
        BLOCK_V=block, num_warps=num_warps_for(block),
    )  # fmt: skip
    return dlogits


def _check_shapes(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} and target {tuple(target.shape)} "
            "must agree on the token dims ([N, V] and [N])"
        )


def _apply(logits, target, ignore_index: int, triton_path: bool) -> torch.Tensor:
    _check_shapes(logits, target)
    rows = target.reshape(-1).contiguous() if triton_path else target.reshape(-1)
    loss = CrossEntropyFunction.apply(as_rows(logits), rows, ignore_index, triton_path)
    return loss.view(target.shape)


def cross_entropy_reference(logits, target, ignore_index=IGNORE_INDEX):
    """The torch path of `cross_entropy` (same contract, no Triton)."""
    return _apply(logits, target, ignore_index, False)


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token loss [N] (fp32; fp64 for fp64 logits) from logits [N, V] and target ids [N].
    Tokens whose target is `ignore_index` get loss 0 and zero gradient. For a vocabulary
    sharded over tensor parallelism use `megatron_lite.parallel.cross_entropy`."""
    return _apply(logits, target, ignore_index, use_triton_path(logits, target))
