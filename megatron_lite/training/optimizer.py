"""AdamW over this rank's parameter shards and the warmup + cosine LR schedule."""

from __future__ import annotations

import math

import torch

from megatron_lite.config import TrainConfig


def build_optimizer(params: list[torch.nn.Parameter], t: TrainConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only (not norms, biases or other 1-D parameters)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # CPU: the per-tensor path (foreach=False) does the same arithmetic on every layout's shards,
    # which the parity tests rely on. CUDA: the fused kernel (one launch for all tensors).
    on_cuda = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(
        groups,
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        foreach=False,
        fused=on_cuda or None,
    )


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to train.lr over warmup_steps, then cosine decay to min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = (t.lr_decay_steps or t.steps) - t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, decay_steps))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
