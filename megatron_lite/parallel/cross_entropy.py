"""Vocab-parallel cross-entropy: logits sharded over TP along the vocabulary.

The per-shard statistics and the gradient are kernels (`megatron_lite.kernels.cross_entropy`);
the two collectives live here: per token, one MAX all-reduce of the shard maxima and one SUM
all-reduce of [sum-exp rescaled to the global max, target logit]. The full vocabulary is never
gathered, and the backward needs no communication. Rank r of the group holds vocabulary ids
[r·V_local, (r+1)·V_local).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.kernels.cross_entropy import (
    IGNORE_INDEX,
    as_rows,
    global_lse,
    logits_grad,
    safe_max,
    shard_stats,
    use_triton_path,
)
from megatron_lite.parallel import mappings

__all__ = ["IGNORE_INDEX", "vocab_parallel_cross_entropy"]


def _global_stats(row_max, sumexp, target_logit, group):
    """Per-shard [N] statistics -> global (row max, sum-exp, target logit) over the TP group."""
    if mappings.size(group) == 1:
        return row_max, sumexp, target_logit
    global_max = mappings.all_reduce(row_max.clone(), group, op=dist.ReduceOp.MAX)
    # rescale each shard's sum from its own max to the global one before summing
    rescaled = sumexp * torch.exp(row_max - safe_max(global_max))
    stats = mappings.all_reduce(torch.stack([rescaled, target_logit]), group)
    return global_max, stats[0], stats[1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, group, triton_path):
        n_vocab = logits.shape[-1]
        vocab_start = 0 if mappings.size(group) == 1 else dist.get_rank(group) * n_vocab
        stats = shard_stats(logits, target, vocab_start, ignore_index, triton_path)
        row_max, sumexp, target_logit = _global_stats(*stats, group)
        lse = global_lse(row_max, sumexp)
        loss = torch.where(target == ignore_index, torch.zeros_like(lse), lse - target_logit)
        ctx.save_for_backward(logits, target, lse)
        ctx.meta = (vocab_start, ignore_index, triton_path)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse = ctx.saved_tensors
        vocab_start, ignore_index, triton_path = ctx.meta
        dlogits = logits_grad(logits, target, lse, dloss, vocab_start, ignore_index, triton_path)
        return dlogits, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp_group, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """logits [..., V/tp] (this rank's vocabulary shard), labels [...] (global ids) -> per-token
    loss [...] (fp32; fp64 for fp64 logits). Labels equal to `ignore_index` give loss 0."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and labels "
            f"{tuple(labels.shape)} must agree on the token dims"
        )
    rows, target = as_rows(logits), labels.reshape(-1)
    triton_path = use_triton_path(rows, target)
    if triton_path:
        target = target.contiguous()
    loss = _VocabParallelCrossEntropy.apply(rows, target, ignore_index, tp_group, triton_path)
    return loss.view(labels.shape)
