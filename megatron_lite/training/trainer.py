"""The training loop: microbatches -> forward/backward (pipelined or not) -> gradient
finalization -> clipping -> AdamW, with per-step metrics."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_lite.config import Config
from megatron_lite.data.sampler import microbatches_at, split_sample
from megatron_lite.models import build_model
from megatron_lite.parallel import mappings
from megatron_lite.parallel.comm_stats import STATS
from megatron_lite.parallel.cross_entropy import IGNORE_INDEX
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import unique_owner
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.pipeline.engine import forward_backward
from megatron_lite.pipeline.p2p import activation_shape, pipeline_dtype
from megatron_lite.pipeline.trace import SpanRecorder, write_trace
from megatron_lite.training.checkpoint import Checkpointer
from megatron_lite.training.lm_step import lm_forward_step
from megatron_lite.training.logging import MetricsLogger
from megatron_lite.training.nonfinite import NonFiniteGuard
from megatron_lite.training.optimizer import build_data_parallel, lr_at, set_lr


class Trainer:
    """Owns the model chunks, optimizer and step loop for one rank."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, dataset, vocab_size: int):
        self.cfg, self.mesh, self.dataset = cfg, mesh, dataset
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.tracker = model_parallel_seed(cfg.train.seed, mesh.tp.rank, mesh.pp.rank)
        self.chunks = [c.to(self.device) for c in build_model(cfg, mesh, self.tracker, vocab_size)]
        if cfg.train.precision == "bf16":  # bf16 weights; fp32 masters live in the optimizer
            for c in self.chunks:
                for p in c.parameters():
                    p.data = p.data.to(torch.bfloat16)
        self.dp = build_data_parallel(self.chunks, mesh, cfg)  # ZeRO-3 replaces the parameters
        self.named_params = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.params = [p for _, p in self.named_params]
        self.optimizer = self.dp.optimizer
        self.logger = MetricsLogger(cfg, active=dist.get_rank() == 0)
        self.guard = NonFiniteGuard(cfg.train.skip_nonfinite_steps)
        self.step = 0
        self.consumed_samples = 0  # the data position (a checkpoint restores it)
        self.checkpointer = Checkpointer(self)  # resumes per train.resume / train.init_from
        self.checkpointer.resume()  # sets step and consumed_samples

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
        """One path for every layout: the pipeline engine (pp = 1 runs no_pipelining)."""
        cfg, mesh = self.cfg, self.mesh
        shape = activation_shape(
            cfg.model.seq_length,
            cfg.train.micro_batch_size,
            cfg.model.hidden_size,
            mesh.cp.size,
            mesh.tp.size,
            cfg.parallel.sequence_parallel,
        )
        recorder = self._pipeline_recorder()
        total = forward_backward(
            self.chunks,
            microbatches,
            lm_forward_step(cfg.train.precision, self.device),
            pp_group=mesh.pp.group,
            tensor_shape=shape,
            dtype=pipeline_dtype(cfg.train.precision),
            device=self.device,
            loss_scale=loss_scale,
            timeout_s=cfg.parallel.timeout_s,
            recorder=recorder,
        )
        if recorder is not None:
            meta = {
                "pp": mesh.pp.size,
                "vpp": len(self.chunks),
                "step": self.step,
                "num_microbatches": len(microbatches),
                "world_size": dist.get_world_size(),
            }
            write_trace(recorder, mesh.pp.rank, meta, cfg.train.out_dir)
        return total

    def _pipeline_recorder(self) -> SpanRecorder | None:
        """Under train.profile_pipeline (pp > 1): a span recorder with a common time origin."""
        if not self.cfg.train.profile_pipeline or self.mesh.pp.size == 1:
            return None
        mappings.all_reduce(
            torch.zeros(1, device=self.device), dist.group.WORLD, kind="profile_sync"
        )
        return SpanRecorder()

    def _microbatches(self) -> list[torch.Tensor]:
        """This rank's microbatches of the next global batch, from the consumed-sample count."""
        t, mesh = self.cfg.train, self.mesh
        batches = microbatches_at(
            self.dataset,
            self.consumed_samples,
            t.global_batch_size,
            t.micro_batch_size,
            mesh.dp.rank,
            mesh.dp.size,
        )
        return [mb.to(self.device) for mb in batches]

    def train_step(self) -> dict:
        cfg, mesh = self.cfg, self.mesh
        t0 = time.perf_counter()
        STATS.start_step(self.step)
        micro = self._microbatches()
        # token-weighted mean over the global batch: every rank divides by the same count
        n_tokens = torch.tensor(
            [float(sum((split_sample(mb)[1] != IGNORE_INDEX).sum() for mb in micro))],
            device=self.device,
            dtype=torch.float64,
        )
        mappings.all_reduce(n_tokens, mesh.dp.group)
        n_tokens = n_tokens.item()
        lr = lr_at(self.step, cfg.train)
        set_lr(self.optimizer, lr)
        self.dp.start_step(len(micro))
        loss_sum = self._forward_backward(micro, 1.0 / n_tokens)
        self.dp.finish_grad_sync()  # the buckets the backward did not already reduce
        # one world all-reduce for [Σg², loss sum]: the loss lives on the last stage (tp rank 0
        # reports it) and each CP rank holds a slice of the sum
        owner = mesh.is_last_stage and mesh.tp.rank == 0
        grad_sq = self.dp.grad_square_sum()
        loss_part = loss_sum.reshape(()).double() if owner else torch.zeros_like(grad_sq)
        sums = torch.stack([grad_sq, loss_part])
        mappings.all_reduce(sums, dist.group.WORLD, kind="all_reduce_norm_loss")
        grad_sq, loss_total = sums.tolist()
        grad_norm = grad_sq**0.5
        loss = loss_total / n_tokens
        skipped = self.guard.check(self.step, loss, grad_norm, loss_part.item(), self.named_params)
        if skipped is None:
            self.dp.clip(grad_norm, cfg.train.grad_clip)
            self.dp.step()  # AdamW on this rank's shards, then the weights all-gathered
        elif dist.get_rank() == 0:
            print(skipped, flush=True)
        moe = self._moe_metrics()
        if self.device.type == "cuda":  # the step's time includes its optimizer kernels
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.consumed_samples += cfg.train.global_batch_size
        global_tokens = cfg.train.global_batch_size * cfg.model.seq_length
        record = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": global_tokens / dt,
            "step_time_s": dt,
            "consumed_samples": self.consumed_samples,
            **({"skipped": True} if skipped else {}),
            **moe,
            **STATS.summary(),
        }
        self.step += 1
        return record

    def _moe_metrics(self) -> dict:
        m, mesh = self.cfg.model, self.mesh
        if m.num_experts is None:
            return {}
        from megatron_lite.moe.layer import moe_metrics

        count_here = mesh.tp.rank == 0 and mesh.cp.rank == 0  # one rank per microbatch shard
        z_loss = bool(m.moe_z_loss_coeff)
        return moe_metrics(self.chunks, m.num_layers, m.num_experts, count_here, z_loss)

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
