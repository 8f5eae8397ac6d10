"""The training loop, a composition of parts that each stand alone (and are tested alone):

- the model and optimizer (`model_setup.py`): this rank's chunks and their data-parallel
  wrapper, whose weights a checkpoint or the layout-independent init then fills;
- the step (`step.py`, `TrainStep`): the microbatches' forward and backward through the
  pipeline engine, gradient finalization, the non-finite guard, clipping and the optimizer;
- evaluation (`evaluation.py`, `Evaluator`): the validation loss, forward only;
- reporting (`reporting.py`): throughput and MFU, the mem/* figures, the MoE metrics.

`Trainer` wires them to the config and runs the loop: the next global batch (read ahead), the
step, its metrics record, evaluation, checkpoints and stop signals. The dry run
(plan --dry-run) runs it as is on fake tensors; its seams are listed in
parallel/dry_run_seams.py (none is here)."""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from megatron_lite import resolve
from megatron_lite.checkpoint import CheckpointDir, Checkpointer
from megatron_lite.config import Config
from megatron_lite.data import build_valid_dataset
from megatron_lite.data.prefetch import Prefetcher
from megatron_lite.data.sampler import microbatches_at
from megatron_lite.parallel import mappings
from megatron_lite.parallel.comm_stats import STATS
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import init_parameters, unique_owner
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.training.evaluation import Evaluator
from megatron_lite.training.flops import model_flops_per_token
from megatron_lite.training.logging import MetricsLogger, reports_at
from megatron_lite.training.model_setup import check_links, rank_device, setup_model_and_optimizer
from megatron_lite.training.nonfinite import NonFiniteGuard, StateGuard
from megatron_lite.training.optimizer import lr_at
from megatron_lite.training.profiling import StepProfiler
from megatron_lite.training.reporting import (
    MemoryReport,
    MoEMetrics,
    MTPMetrics,
    Throughput,
    peak_tflops_of,
)
from megatron_lite.training.rerun import StepRerun
from megatron_lite.training.signals import StopSignals
from megatron_lite.training.step import lm_train_step
from megatron_lite.training.straggler import StragglerDetector


class Trainer:
    """Owns the model chunks, optimizer and step loop for one rank."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, dataset, vocab_size: int):
        self.cfg, self.mesh, self.dataset = cfg, mesh, dataset
        self.device = rank_device()
        check_links(cfg, mesh, self.device)
        t = cfg.train
        self.tracker = model_parallel_seed(t.seed, mesh.tp.rank, mesh.pp.rank)
        self.step, self.consumed_samples = 0, 0  # the data position (a checkpoint restores it)
        self.eod_mask_id = resolve.eod_mask_id(cfg.data)  # data.eod_mask_loss: split_sample's
        self.checkpoint_dir = CheckpointDir(cfg)  # groups and run lock; what resume will load
        will_load = self.checkpoint_dir.will_load()
        self.chunks, self.dp = setup_model_and_optimizer(
            cfg, mesh, self.tracker, vocab_size, self.device
        )
        self.named_params = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.state_guard = StateGuard(self.chunks, self.device)  # the expert bias, and the like
        self.params = [p for _, p in self.named_params]
        self.optimizer = self.dp.optimizer
        self.logger = MetricsLogger(cfg, active=dist.get_rank() == 0)
        self.guard = NonFiniteGuard(t.skip_nonfinite_steps)
        self._prefetch: Prefetcher | None = None  # reads the next batches during train()
        self.stop_requested = False  # a rank got SIGTERM/SIGINT/SIGUSR1 (agreed every step)
        self.memory = MemoryReport(
            self.dp, self.chunks, self.params, self.device, cfg.log.memory_steps,
            reports_at=lambda step: reports_at(step, cfg),
        )  # fmt: skip
        self.rerun = StepRerun(t.rerun_on, t.spike_factor, self.device, self.tracker)
        self.stepper = lm_train_step(
            cfg, mesh, self.chunks, self.dp, self.device,
            guard=self.guard, memory_tracker=lambda: self.memory.tracker,
            rerun=self.rerun, before_replay=self._drop_eval_stats,
        )  # fmt: skip
        self.straggler = (
            StragglerDetector(cfg.log.straggler_interval, self.device, mesh.pp.rank)
            if cfg.log.straggler
            else None
        )
        self.holds_loss = self.stepper.holds_loss  # this rank computes the loss
        tokens = t.global_batch_size * cfg.model.seq_length
        self.flops_per_step = model_flops_per_token(cfg, vocab_size) * tokens
        world, peak = dist.get_world_size(), peak_tflops_of(self.device, dist.get_rank())
        self.throughput = Throughput(self.flops_per_step, tokens, world, peak)
        self.moe = MoEMetrics.of_model(cfg.model, self.chunks, mesh)  # None: a dense model
        self.mtp = MTPMetrics.of_model(cfg.model, self.chunks, mesh)  # None: no MTP
        self.checkpointer = Checkpointer(  # resumes per train.resume / train.init_from
            cfg, mesh, self.chunks, self.dp, self.tracker, self.device, self.checkpoint_dir
        )
        self.signals = StopSignals(self.checkpointer, t)  # installed by train()
        loaded = self.checkpointer.resume()  # (step, consumed_samples), None: nothing loaded
        if (loaded is not None) != will_load:  # resume either loads what will_load saw or raises
            raise RuntimeError(f"checkpoint expected {will_load}, loaded {loaded is not None}")
        if loaded is not None:
            self.step, self.consumed_samples = loaded
        if loaded is None:
            for chunk in self.chunks:
                init_parameters(chunk, t.seed)  # each rank draws only its shard
            self.optimizer.sync_masters_from_params()
        self.evaluator = self._evaluator() if t.eval_interval > 0 else None

    def _evaluator(self) -> Evaluator:
        t = self.cfg.train
        return Evaluator(
            build_valid_dataset(self.cfg),
            functools.partial(self._forward_backward, loss_scale=1.0, forward_only=True),
            self.mesh, iters=t.eval_iters, global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size, holds_loss=self.holds_loss,
            device=self.device, eod_mask_id=self.eod_mask_id,
            after=self._drop_eval_stats,
        )  # fmt: skip

    def _drop_eval_stats(self) -> None:
        """The MoE routing statistics and MTP loss sums of an evaluation (or of a replayed
        step's first run) are not the step's."""
        for metrics in (self.moe, self.mtp):
            if metrics is not None:
                metrics.pop_stats()

    @property
    def memory_tracker(self):
        """The MemoryTracker naming the step's phases (a dry run attaches its own), or None."""
        return self.memory.tracker

    @memory_tracker.setter
    def memory_tracker(self, tracker) -> None:
        self.memory.tracker = tracker

    @property
    def last_activation_report(self) -> dict | None:
        """The last metered step's saved-tensor report (CPU; MemoryReport.measure)."""
        return self.memory.last_activation_report

    def memory_report(self) -> dict[str, int]:
        """mem/* max over ranks (a collective; MemoryReport.report)."""
        return self.memory.report()

    def evaluate(self) -> float:
        """The validation loss (evaluation.Evaluator); needs train.eval_interval > 0."""
        return self.evaluator()

    def num_parameters(self) -> int:
        """Parameters of the whole model (each element once), summed over all ranks."""
        here = sum(p.numel() for p in self.params if unique_owner(p.meta, self.mesh))
        t = torch.tensor([float(here)], dtype=torch.float64, device=self.device)
        mappings.all_reduce(t, dist.group.WORLD)
        return int(t.item())

    def _forward_backward(self, microbatches, loss_scale: float, forward_only: bool = False):
        return self.stepper.forward_backward(microbatches, loss_scale, forward_only, self.step)

    def _fetch(self, consumed_samples: int) -> list[torch.Tensor]:
        """This rank's microbatches of the global batch starting at sample `consumed_samples`."""
        t, dp = self.cfg.train, self.mesh.dp
        gbs, mbs = t.global_batch_size, t.micro_batch_size
        return microbatches_at(self.dataset, consumed_samples, gbs, mbs, dp.rank, dp.size)

    def _microbatches(self) -> list[torch.Tensor]:
        """The next global batch's microbatches, read ahead on a thread while training runs."""
        if self._prefetch is not None:
            batches = self._prefetch.get(self.consumed_samples)
        else:
            batches = self._fetch(self.consumed_samples)
        return [mb.to(self.device, non_blocking=True) for mb in batches]

    def train_step(self) -> dict:
        """One optimizer step -> its metrics record. The run's first log.memory_steps run
        under a MemoryTracker (unless one is attached already, as a dry run's): their mem/*
        are the step's peak by category (MemoryReport.step_memory)."""
        with self.memory.tracked():
            return self._train_step()

    def _flags(self) -> list[float]:
        """Summed over the world in the step's all-reduce, so every rank agrees: a stop
        signal (or rank 0's failed write of metrics.jsonl: it stops the run like a signal),
        and a changed activation peak (all ranks reduce the memory report again); then the
        MTP loss sums (MTPMetrics)."""
        signalled = self.signals.received is not None or self.logger.error is not None
        mtp = self.mtp.sums() if self.mtp is not None else []  # the MTP loss sums, per module
        return [float(signalled), self.memory.activations_changed(), *mtp]

    def _train_step(self) -> dict:
        """The step (TrainStep.run on the next global batch), then its metrics record."""
        t0, t = time.perf_counter(), self.cfg.train
        STATS.start_step(self.step)
        lr = lr_at(self.step, t)
        measure = functools.partial(self.memory.measure, step=self.step)
        micro = self._microbatches()
        if self.straggler is not None:
            self.straggler.start()
        out = self.stepper.run(micro, lr, self.step, flags=self._flags, measure=measure)
        if self.straggler is not None:
            self.straggler.stop()
        signals, act_changes, *mtp_sums = out.flags
        self.stop_requested = signals > 0
        per_layer = reports_at(self.step, self.cfg)
        moe = self.moe(out.skipped is None, per_layer) if self.moe is not None else {}
        mtp = self.mtp.record(mtp_sums, out.tokens) if self.mtp is not None else {}
        self.state_guard.check(self.step + 1)  # before the step's checkpoint could store it
        if self.device.type == "cuda":  # the step's time includes its optimizer kernels
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.consumed_samples += t.global_batch_size
        record = {
            "step": self.step,
            "loss": out.loss,
            "lr": lr,
            "grad_norm": out.grad_norm,
            **mtp,
            **self.throughput(dt),
            "consumed_samples": self.consumed_samples,
            **({"skipped": True} if out.skipped else {}),
            **self.memory.step_memory(act_changes > 0),
            **moe,
            **self._offload_record(),
            **STATS.summary(),
            **self.rerun.metrics(),
            **(self.straggler.report(self.step) if self.straggler is not None else {}),
        }
        self.step += 1
        return record

    def _offload_record(self) -> dict:
        """model.activation_offload: this rank's offload/* figures of the step (bytes moved to
        and from the host, the host copies' peak, the most copies in flight, late reloads)."""
        off = self.stepper.offloader
        if off is None:
            return {}
        st = off.stats
        return {
            "offload/bytes": st.offloaded_bytes,
            "offload/reloaded_bytes": st.reloaded_bytes,
            "offload/peak_host_bytes": st.peak_host_bytes,
            "offload/max_in_flight": st.max_in_flight,
            "offload/late_reloads": st.late_reloads,
        }

    def _report_compile(self, record: dict) -> None:
        """model.compile: after this run's first step (the regions compile lazily, in it) add
        the step's time and dynamo's counts to its record and print them on rank 0."""
        from megatron_lite.models.compile import compile_report

        report = compile_report()
        record["compile/first_step_s"] = record["step_time_s"]
        record["compile/graph_breaks"] = sum(report.graph_breaks.values())
        record["compile/recompiles"] = report.recompiles
        record["compile/graphs"] = report.graphs
        if dist.get_rank() == 0:
            print(f"compile: first step {record['step_time_s']:.1f} s (tracing and compiling)")
            print("\n".join(report.lines()), flush=True)

    def _eval_due(self) -> bool:
        every = self.cfg.train.eval_interval
        return every > 0 and (self.step % every == 0 or self.step == self.cfg.train.steps)

    def train(self) -> list[dict]:
        """Steps until train.steps (or an agreed stop) with evaluation, checkpoints and the
        metrics log -> the steps' records."""
        records = []
        first, t = self.step, self.cfg.train
        self.signals.install()
        start, gbs = self.consumed_samples, t.global_batch_size  # bound now: the loop moves it
        positions = [start + k * gbs for k in range(t.steps - first)]
        self._prefetch = Prefetcher(self._fetch, positions, depth=2)
        profiler = StepProfiler(
            t.profile_steps, t.out_dir, dist.get_rank(), self.device, t.profile_memory_snapshot
        )
        try:
            while self.step < t.steps:
                profiler.before_step(self.step)
                record = self.train_step()
                profiler.after_step(record["step"])
                if self._eval_due():
                    record["eval_loss"] = self.evaluate()
                # saves when due; stops when a rank got a signal (agreed in train_step)
                failed = self.logger.error
                stop = self.signals.after_step(
                    record,
                    self.step,
                    self.consumed_samples,
                    self.stop_requested,
                    f"could not write {failed.filename}" if failed else None,
                )
                if self.cfg.model.compile and record["step"] == first:
                    self._report_compile(record)
                self.logger.log(record, first)
                records.append(record)
                if stop:
                    break
        finally:
            profiler.close()
            self._prefetch.close()
            self._prefetch = None
        self.checkpointer.finish()
        self.signals.restore()
        self.logger.close()
        return records
