"""The training loop: microbatches -> forward/backward (pipelined or not) -> gradient
finalization -> clipping -> AdamW, with per-step metrics."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from megatron_lite.config import Config
from megatron_lite.data.sampler import microbatches_for_step
from megatron_lite.models import build_model
from megatron_lite.parallel import mappings
from megatron_lite.parallel.comm_stats import STATS
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import unique_owner
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.training.checkpoint import Checkpointer
from megatron_lite.training.grads import clip_grads, finalize_grads, local_grad_square_sum
from megatron_lite.training.logging import MetricsLogger
from megatron_lite.training.optimizer import build_optimizer, lr_at, set_lr

IGNORE_INDEX = -100


def autocast(cfg: Config, device: torch.device):
    if cfg.train.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_backward_no_pipelining(
    chunk, microbatches, loss_scale: float, cfg: Config, device
) -> torch.Tensor:
    """Gradient accumulation over microbatches; returns the summed (unscaled) token loss."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for mb in microbatches:
        tokens, labels = mb[:, :-1], mb[:, 1:]  # [b, s]
        with autocast(cfg, device):
            losses = chunk(tokens, labels)  # [s/cp, b]
        loss = losses.sum()
        (loss * loss_scale).backward()
        total += loss.detach()
    return total


class Trainer:
    """Owns the model chunks, optimizer and step loop for one rank."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, dataset, vocab_size: int):
        self.cfg, self.mesh, self.dataset = cfg, mesh, dataset
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.tracker = model_parallel_seed(cfg.train.seed, mesh.tp_rank, mesh.pp_rank)
        self.chunks = [c.to(self.device) for c in build_model(cfg, mesh, self.tracker, vocab_size)]
        self.params = [p for c in self.chunks for p in c.parameters()]
        self.embedding_param = next(
            (c.embedding.weight for c in self.chunks if c.pre_process), None
        )
        self.optimizer = build_optimizer(self.params, cfg.train)
        self.logger = MetricsLogger(cfg, active=dist.get_rank() == 0)
        self.step = 0
        self.checkpointer = Checkpointer(self)  # resumes per train.resume / train.init_from
        self.checkpointer.resume()

    def num_parameters(self) -> int:
        """Parameters of the whole model (each element once), summed over all ranks."""
        t = torch.tensor(
            [float(sum(p.numel() for p in self.params if unique_owner(p.meta, self.mesh)))],
            dtype=torch.float64,
            device=self.device,
        )
        mappings.all_reduce(t, dist.group.WORLD)
        return int(t.item())

    def _forward_backward(self, microbatches, loss_scale: float) -> torch.Tensor:
        if self.mesh.pp_size == 1:
            return forward_backward_no_pipelining(
                self.chunks[0], microbatches, loss_scale, self.cfg, self.device
            )
        from megatron_lite.pipeline.engine import forward_backward_pipelining

        return forward_backward_pipelining(self, microbatches, loss_scale)

    def train_step(self) -> dict:
        cfg, mesh = self.cfg, self.mesh
        t0 = time.perf_counter()
        STATS.start_step(self.step)
        micro = [
            mb.to(self.device)
            for mb in microbatches_for_step(
                self.dataset,
                self.step,
                cfg.train.global_batch_size,
                cfg.train.micro_batch_size,
                mesh.dp_rank,
                mesh.dp_size,
            )
        ]
        # token-weighted mean over the global batch: every rank divides by the same count
        n_tokens = torch.tensor(
            [float(sum((mb[:, 1:] != IGNORE_INDEX).sum() for mb in micro))],
            device=self.device,
            dtype=torch.float64,
        )
        mappings.all_reduce(n_tokens, mesh.dp_group)
        n_tokens = n_tokens.item()
        lr = lr_at(self.step, cfg.train)
        set_lr(self.optimizer, lr)
        loss_sum = self._forward_backward(micro, 1.0 / n_tokens)
        finalize_grads(self.params, mesh, cfg.model.tie_embeddings, self.embedding_param)
        # one world all-reduce for [Σg², loss sum]: the loss lives on the last stage (tp rank 0
        # reports it) and each CP rank holds a slice of the sum
        owner = mesh.is_last_stage and mesh.tp_rank == 0
        grad_sq = local_grad_square_sum(self.params, mesh)
        loss_part = loss_sum.reshape(()).double() if owner else torch.zeros_like(grad_sq)
        sums = torch.stack([grad_sq, loss_part])
        mappings.all_reduce(sums, dist.group.WORLD, kind="all_reduce_norm_loss")
        grad_sq, loss_total = sums.tolist()
        grad_norm = grad_sq**0.5
        clip_grads(self.params, grad_norm, cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        moe = {}
        if cfg.model.num_experts is not None:
            from megatron_lite.moe.layer import moe_metrics

            moe = moe_metrics(self.chunks, mesh)
        if self.device.type == "cuda":  # the step's time includes its optimizer kernels
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        global_tokens = cfg.train.global_batch_size * cfg.model.seq_length
        record = {
            "step": self.step,
            "loss": loss_total / n_tokens,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": global_tokens / dt,
            "step_time_s": dt,
            **moe,
            **STATS.summary(),
        }
        self.step += 1
        return record

    def train(self) -> list[dict]:
        records = []
        first = self.step
        self.checkpointer.start()
        while self.step < self.cfg.train.steps:
            record = self.train_step()
            stop = self.checkpointer.after_step(record)  # saves when due; stop after a signal
            self.logger.log(record, first)
            records.append(record)
            if stop:
                break
        self.checkpointer.finish()
        self.logger.close()
        return records
