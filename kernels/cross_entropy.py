"""Per-token cross-entropy over a (possibly tensor-parallel) vocabulary, never materializing
the softmax: Triton kernels + torch reference.

    loss[i] = logsumexp(logits[i, :]) - logits[i, target[i]]       (0 where target == ignore)

logits: [N, V_local] (any leading shape works; it is flattened), target: [N] global vocabulary
ids. With a process group of size tp the vocabulary is sharded evenly in rank order: rank r
holds ids [r·V_local, (r+1)·V_local). Each rank reduces its shard to three numbers per token
(max, sum of exp relative to that max, target logit if local), and only those cross ranks:
one MAX all-reduce and one SUM all-reduce of [2, N]. The backward needs no collective:
dlogits = (softmax - onehot) · dloss, written blockwise in the logits dtype.

Logits may hold -inf (padded vocabulary entries masked by the caller): they contribute exp = 0,
and a shard or block that is entirely -inf is handled without NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from megatron_lite.kernels.dispatch import as_rows, compute_dtype, num_warps_for, use_triton

from megatron_lite.parallel.mappings import all_reduce

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


def _vocab_start(n_vocab: int, group) -> int:
    if group is None or dist.get_world_size(group) == 1:
        return 0
    return dist.get_rank(group) * n_vocab


def _global_lse(local_max, local_sumexp, target_logit, group):
    """[N] per-shard stats -> [N] global log-sum-exp and target logit (2 small all-reduces)."""
    safe = lambda m: torch.where(m == float("-inf"), torch.zeros_like(m), m)
    if group is not None and dist.get_world_size(group) > 1:
        global_max = all_reduce(local_max.clone(), group, op=dist.ReduceOp.MAX)
        # rescale each shard's sum from its own max to the global one before summing
        rescaled = local_sumexp * torch.exp(local_max - safe(global_max))
        stats = all_reduce(torch.stack([rescaled, target_logit]), group)
        local_sumexp, target_logit, local_max = stats[0], stats[1], global_max
    return safe(local_max) + torch.log(local_sumexp), target_logit


def _shard_stats_torch(logits, target, vocab_start, ignore_index):
    """Torch version of the forward kernel: per-row max, sum-exp, local target logit."""
    x = logits.to(compute_dtype(logits.dtype))
    n_vocab = x.shape[-1]
    m = x.max(dim=-1).values
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    s = torch.exp(x - m_safe[:, None]).sum(-1)
    local = target - vocab_start
    is_local = (local >= 0) & (local < n_vocab) & (target != ignore_index)
    t_logit = x.gather(1, local.clamp(0, n_vocab - 1)[:, None]).squeeze(1)
    return m, s, torch.where(is_local, t_logit, torch.zeros_like(t_logit))


def _grad_torch(logits, target, lse, dloss, vocab_start, ignore_index):
    """Torch version of the backward kernel: (softmax - onehot) · dloss, logits dtype."""
    p = torch.exp(logits.to(lse.dtype) - lse[:, None])
    local = target - vocab_start
    is_local = (local >= 0) & (local < logits.shape[-1]) & (target != ignore_index)
    rows = torch.nonzero(is_local).squeeze(1)
    p[rows, local[rows]] -= 1.0
    d = p * dloss.to(p.dtype)[:, None]
    d[target == ignore_index] = 0.0
    return d.to(logits.dtype)


class CrossEntropyFunction(torch.autograd.Function):
    """Per-token vocab-parallel cross-entropy; `triton` picks the kernels or the torch path."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, group, triton_path):
        vocab_start = _vocab_start(logits.shape[-1], group)
        if triton_path:
            stats = _stats_triton(logits, target, vocab_start, ignore_index)
        else:
            stats = _shard_stats_torch(logits, target, vocab_start, ignore_index)
        lse, target_logit = _global_lse(*stats, group)
        loss = torch.where(target == ignore_index, torch.zeros_like(lse), lse - target_logit)
        ctx.save_for_backward(logits, target, lse)
        ctx.meta = (vocab_start, ignore_index, triton_path)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse = ctx.saved_tensors
        vocab_start, ignore_index, triton_path = ctx.meta
        if triton_path:
            dlogits = _grad_triton(logits, target, lse, dloss, vocab_start, ignore_index)
        else:
            dlogits = _grad_torch(logits, target, lse, dloss, vocab_start, ignore_index)
        return dlogits, None, None, None, None


def _block_v(n_vocab: int) -> int:
    return min(triton.next_power_of_2(n_vocab), BLOCK_V)


def _stats_triton(logits, target, vocab_start, ignore_index):
    n, n_vocab = logits.shape
    m, s, t = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    block = _block_v(n_vocab)
    _ce_fwd_kernel[(n,)](
        logits, target, m, s, t, logits.stride(0), n_vocab, vocab_start, ignore_index,
        BLOCK_V=block, num_warps=num_warps_for(block),
    )  # fmt: skip
    return m, s, t


def _grad_triton(logits, target, lse, dloss, vocab_start, ignore_index):
    n, n_vocab = logits.shape
    dlogits = torch.empty_like(logits)
    block = _block_v(n_vocab)
    _ce_bwd_kernel[(n,)](
        logits, target, lse, dloss, dlogits, logits.stride(0), dloss.stride(0),
        dlogits.stride(0), n_vocab, vocab_start, ignore_index,
        BLOCK_V=block, num_warps=num_warps_for(block),
    )  # fmt: skip
    return dlogits


def cross_entropy_reference(logits, target, ignore_index=-100, group=None):
    """Torch-only cross-entropy with the same contract (and collectives) as `cross_entropy`."""
    shape = target.shape
    loss = CrossEntropyFunction.apply(
        as_rows(logits), target.reshape(-1), ignore_index, group, False
    )
    return loss.view(shape)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token loss [N] (fp32; fp64 for fp64 logits) from logits [N, V_local] and global
    target ids [N].

    `group` is the tensor-parallel group over which the vocabulary is sharded (None: the full
    vocabulary is local). Tokens whose target is `ignore_index` get loss 0 and zero gradient.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} and target {tuple(target.shape)} "
            "must agree on the token dims ([N, V_local] and [N])"
        )
    if target.numel() == 0 or not use_triton(logits):
        return cross_entropy_reference(logits, target, ignore_index, group)
    loss = CrossEntropyFunction.apply(
        as_rows(logits), target.reshape(-1).contiguous(), ignore_index, group, True
    )
    return loss.view(target.shape)
