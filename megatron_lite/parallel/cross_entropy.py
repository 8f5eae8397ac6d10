"""Vocab-parallel cross-entropy: logits sharded over TP along the vocabulary.

Only per-token max, sum-exp and target logit cross ranks (inside `kernels.cross_entropy`); the
full vocabulary is never gathered.
"""

from __future__ import annotations

import torch

from megatron_lite import kernels


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp_group, ignore_index: int = -100
) -> torch.Tensor:
    """logits [s, b, V/tp], labels [s, b] (global ids) -> per-token loss [s, b] (fp32)."""
    s, b, v_local = logits.shape
    loss = kernels.cross_entropy(
        logits.reshape(s * b, v_local),
        labels.reshape(s * b),
        ignore_index=ignore_index,
        group=tp_group,
    )
    return loss.view(s, b)
