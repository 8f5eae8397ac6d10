"""The data-parallel optimizer for a run config (train.optimizer, a registered OptimizerSpec),
and the warmup + cosine LR schedule."""

from __future__ import annotations

import math

import torch

from megatron_lite import resolve
from megatron_lite.config import Config, TrainConfig
from megatron_lite.parallel import data_parallel
from megatron_lite.parallel.data_parallel import DataParallelWrapper, muon_spec
from megatron_lite.parallel.data_parallel.optimizer_spec import get_optimizer
from megatron_lite.parallel.data_parallel.rules import REDUCE_DTYPES


def optimizer_arguments(t: TrainConfig) -> dict:
    """build_data_parallel's optimizer arguments from the train.* keys: train.optimizer, lr,
    weight_decay and optimizer_args for every optimizer; adam_beta1/2 and adam_eps for one
    with hyperparameters betas and eps."""
    own = get_optimizer(t.optimizer).hyperparameters
    args = t.optimizer_args
    if t.optimizer == "muon":
        args = {**muon_spec.config_arguments(t), **args}
    return dict(
        optimizer=t.optimizer,
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2) if "betas" in own else None,
        eps=t.adam_eps if "eps" in own else None,
        weight_decay=t.weight_decay,
        optimizer_args=dict(args) or None,
    )


def build_data_parallel(chunks, mesh, cfg: Config, device=None) -> DataParallelWrapper:
    """`parallel.data_parallel.build_data_parallel` with the config's fields (stage 3: FSDP2,
    chunks on the meta device get their shards' storage on `device`; AdamW: weight decay on
    matrices only; the optimizer's arguments: `optimizer_arguments`). The weights compute in
    the parameters' dtype: bf16 under train.precision=bf16 (the trainer casts them first)."""
    p, t = cfg.parallel, cfg.train
    return data_parallel.build_data_parallel(
        chunks,
        mesh,
        zero_stage=p.zero_stage,
        **optimizer_arguments(t),
        dp_shard=p.dp_shard,
        bucket_size=p.ddp_bucket_size,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        grad_reduce_dtype=REDUCE_DTYPES[p.grad_reduce_dtype],
        offload=False if t.optimizer_offload == "none" else t.optimizer_offload,
        nvme_path=t.nvme_path,
        nvme_buffer_mb=t.nvme_buffer_mb,
        reshard_after_forward=p.reshard_after_forward,
        zero3_grad_reduce=p.zero3_grad_reduce,
        tie_embeddings=resolve.embedding_copy(cfg.model),  # a copy on the last stage
        device=device,
    )


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to train.lr over warmup_steps, then cosine decay to min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = (t.lr_decay_steps or t.steps) - t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, decay_steps))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr: the schedule's, times the group's "lr_scale" (train.muon_lr / lr)."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
