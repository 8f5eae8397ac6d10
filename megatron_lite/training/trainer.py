"""The training loop: microbatches -> forward/backward (pipelined or not) -> gradient
finalization -> clipping -> AdamW, with per-step metrics."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from megatron_lite import resolve
from megatron_lite.checkpoint import CheckpointDir, Checkpointer
from megatron_lite.config import Config
from megatron_lite.data import build_valid_dataset
from megatron_lite.data.prefetch import Prefetcher
from megatron_lite.data.sampler import microbatches_at, split_sample
from megatron_lite.models import build_model
from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.comm_stats import STATS
from megatron_lite.parallel.cross_entropy import IGNORE_INDEX
from megatron_lite.parallel.data_parallel.memory import TERMS
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import init_parameters, unique_owner
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.pipeline.engine import forward_backward
from megatron_lite.pipeline.p2p import activation_shape, pipeline_dtype, warm_up
from megatron_lite.pipeline.schedules import resolve_schedule
from megatron_lite.pipeline.trace import SpanRecorder, write_trace
from megatron_lite.training.activation_memory import SavedTensorMeter
from megatron_lite.training.flops import model_flops_per_token, peak_tflops
from megatron_lite.training.lm_step import lm_forward_step
from megatron_lite.training.logging import MetricsLogger, reports_at
from megatron_lite.training.memory_tracker import CATEGORIES, MemoryTracker
from megatron_lite.training.nonfinite import NonFiniteGuard, StateGuard
from megatron_lite.training.optimizer import build_data_parallel, lr_at, set_lr
from megatron_lite.training.profiling import StepProfiler
from megatron_lite.training.signals import StopSignals


class Trainer:
    """Owns the model chunks, optimizer and step loop for one rank."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, dataset, vocab_size: int):
        self.cfg, self.mesh, self.dataset = cfg, mesh, dataset
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        # before anything else: a broken pipeline link (NCCL/P2P set-up, a missing rank) fails
        # here with a P2PError naming rank and peer, not in step 1
        warm_up(mesh.pp.group, self.device, cfg.parallel.timeout_s)
        a2a = resolve.cp_a2a_size(cfg.parallel)
        if mesh.cp_a2a.size != a2a:  # a mesh built for another CP type
            raise ValueError(
                f"parallel.cp_comm_type={cfg.parallel.cp_comm_type}: the mesh's Ulysses groups "
                f"have {mesh.cp_a2a.size} ranks, the config needs {a2a}; "
                "build it with megatron_lite.resolve.rank_layout(cfg.parallel, world)"
            )
        warm_up(mesh.cp_ring.group, self.device, cfg.parallel.timeout_s, axis="cp")
        self.tracker = model_parallel_seed(cfg.train.seed, mesh.tp.rank, mesh.pp.rank)
        self.step = 0
        self.eod_mask_id = resolve.eod_mask_id(cfg.data)  # data.eod_mask_loss: split_sample's
        self.consumed_samples = 0  # the data position (a checkpoint restores it)
        self.checkpoint_dir = CheckpointDir(cfg)  # groups and run lock; what resume will load
        # built on the meta device, given uninitialized storage on this rank's device (ZeRO-3:
        # only its FSDP2 shards, so no rank holds its whole TP-local model) and drawn after the
        # data-parallel wrapper, unless a checkpoint will fill them
        will_load = self.checkpoint_dir.will_load()
        zero3 = cfg.parallel.zero_stage == 3
        where = torch.device("meta") if zero3 else self.device
        self.chunks = build_model(cfg, mesh, self.tracker, vocab_size, init=False, device=where)
        if cfg.train.precision == "bf16":  # bf16 weights; fp32 masters live in the optimizer
            for c in self.chunks:  # untrained state (the MoE expert bias) stays fp32
                for p in c.parameters():
                    if p.requires_grad:
                        p.data = p.data.to(torch.bfloat16)
        # the last virtual stage (the loss): the last pipeline rank, or the first under the V
        # placement (zb-v, dualpipev)
        self.holds_loss = any(c.post_process for c in self.chunks)
        self.dp = build_data_parallel(self.chunks, mesh, cfg, self.device)  # ZeRO-3: new params
        for c in self.chunks if zero3 else []:  # RoPE tables, vocabulary mask: built on meta
            c.init_buffers(self.device)
        self.named_params = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.state_guard = StateGuard(self.chunks, self.device)  # the expert bias, and the like
        self.params = [p for _, p in self.named_params]
        self.optimizer = self.dp.optimizer
        self.logger = MetricsLogger(cfg, active=dist.get_rank() == 0)
        self.guard = NonFiniteGuard(cfg.train.skip_nonfinite_steps)
        self._prefetch: Prefetcher | None = None  # reads the next batches during train()
        self.stop_requested = False  # a rank got SIGTERM/SIGINT/SIGUSR1 (agreed every step)
        self._memory: dict[str, int] | None = None  # mem/* of the steps (see _step_memory)
        self._step_peak: dict[str, int] | None = None  # the last tracked step's peak
        self.memory_tracker = None  # a MemoryTracker while a step is tracked (or a dry run's)
        self._tracked = 0  # steps this trainer ran under its own tracker
        self._activations: int | None = None  # this rank's activation peak of the last step
        self._activations_reduced: int | None = None  # ... as it was when last reduced
        self._cuda_peaks = [0, 0]  # allocated, reserved: the run's peaks (reset every step)
        # the step's saved-tensor report (CPU): peak_bytes, by_label, recomputed_bytes
        self.last_activation_report: dict | None = None
        self.flops_per_step = model_flops_per_token(cfg, vocab_size) * (
            cfg.train.global_batch_size * cfg.model.seq_length
        )
        self.peak_tflops = self._peak_tflops()
        self.checkpointer = Checkpointer(  # resumes per train.resume / train.init_from
            cfg, mesh, self.chunks, self.dp, self.tracker, self.device, self.checkpoint_dir
        )
        self.signals = StopSignals(self.checkpointer, cfg.train)  # installed by train()
        loaded = self.checkpointer.resume()  # (step, consumed_samples), None: nothing loaded
        if (loaded is not None) != will_load:  # resume either loads what will_load saw or raises
            raise RuntimeError(f"checkpoint expected {will_load}, loaded {loaded is not None}")
        if loaded is not None:
            self.step, self.consumed_samples = loaded
        if loaded is None:
            for chunk in self.chunks:
                init_parameters(chunk, cfg.train.seed)  # each rank draws only its shard
            self.optimizer.sync_masters_from_params()
        self.valid_dataset = build_valid_dataset(cfg) if cfg.train.eval_interval > 0 else None

    def num_parameters(self) -> int:
        """Parameters of the whole model (each element once), summed over all ranks."""
        t = torch.tensor(
            [float(sum(p.numel() for p in self.params if unique_owner(p.meta, self.mesh)))],
            dtype=torch.float64,
            device=self.device,
        )
        mappings.all_reduce(t, dist.group.WORLD)
        return int(t.item())

    def evaluate(self) -> float:
        """Validation loss: the token-weighted mean over the first train.eval_iters global
        batches of the validation set (the same batches every time), forward only. The
        training samples, the RNG states and the MoE statistics are left as they were."""
        t, mesh = self.cfg.train, self.mesh
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        owner = self.holds_loss and mesh.tp.rank == 0
        for it in range(t.eval_iters):
            batches = microbatches_at(
                self.valid_dataset,
                it * t.global_batch_size,
                t.global_batch_size,
                t.micro_batch_size,
                mesh.dp.rank,
                mesh.dp.size,
            )
            micro = [mb.to(self.device) for mb in batches]
            loss = self._forward_backward(micro, 1.0, forward_only=True)
            if owner:
                sums[0] += loss.double().reshape(())
            if mesh.tp.rank == 0 and mesh.cp.rank == 0 and self.holds_loss:
                for mb in micro:  # each dp rank's tokens once; summed on the device
                    sums[1] += (split_sample(mb, self.eod_mask_id)[1] != IGNORE_INDEX).sum()
        mappings.all_reduce(sums, dist.group.WORLD, kind="all_reduce_eval")
        for layer in self._moe_layers():
            layer.pop_stats()  # evaluation routes tokens too: not this step's statistics
        return sums[0].item() / sums[1].item()

    def _moe_layers(self) -> list:
        if self.cfg.model.num_experts is None:
            return []
        from megatron_lite.moe.layer import moe_layers

        return moe_layers(self.chunks)

    def _forward_backward(
        self, microbatches, loss_scale: float, forward_only: bool = False
    ) -> torch.Tensor:
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
        recorder = None if forward_only else self._pipeline_recorder()
        total = forward_backward(
            self.chunks,
            microbatches,
            lm_forward_step(cfg.train.precision, self.device, self.eod_mask_id),
            pp_group=mesh.pp.group,
            tensor_shape=shape,
            dtype=pipeline_dtype(cfg.train.precision, cfg.model.fp32_residual_connection),
            device=self.device,
            loss_scale=loss_scale,
            timeout_s=cfg.parallel.timeout_s,
            recorder=recorder,
            forward_only=forward_only,
            before_backward=self.dp.before_backward,
            after_weight=self.dp.after_weight,
            weight_phase=lambda: self._phase("weight", working=True),
            schedule=cfg.parallel.pipeline_schedule,
        )
        if recorder is not None:
            meta = {
                "pp": mesh.pp.size,
                "vpp": len(self.chunks),
                "step": self.step,
                "num_microbatches": len(microbatches),
                "schedule": resolve_schedule(cfg.parallel.pipeline_schedule, len(self.chunks)),
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
        if self.device.type == "cuda":  # NCCL returns once queued: wait until every rank is in
            torch.cuda.synchronize()
        return SpanRecorder()

    def _fetch(self, consumed_samples: int) -> list[torch.Tensor]:
        """This rank's microbatches of the global batch starting at sample `consumed_samples`."""
        t, mesh = self.cfg.train, self.mesh
        return microbatches_at(
            self.dataset,
            consumed_samples,
            t.global_batch_size,
            t.micro_batch_size,
            mesh.dp.rank,
            mesh.dp.size,
        )

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
        are the step's peak by category (see _step_memory)."""
        own = self.memory_tracker is None and self._tracked < self.cfg.log.memory_steps
        if not own:
            return self._train_step()
        buffers = [b for c in self.chunks for b in c.buffers()]
        with MemoryTracker(self.device.type) as tracker:
            tracker.label_model_states(self.dp)
            tracker.label(buffers, "buffers")
            self.memory_tracker = tracker
            try:
                return self._train_step()
            finally:
                self.memory_tracker = None
                self._tracked += 1

    def _phase(self, name: str, working: bool = False):
        """The tracker's phase `name` (working: new storages are temporaries), if tracked."""
        t = self.memory_tracker
        return t.phase(name, working) if t is not None else contextlib.nullcontext()

    def _train_step(self) -> dict:
        cfg, mesh = self.cfg, self.mesh
        t0 = time.perf_counter()
        STATS.start_step(self.step)
        micro = self._microbatches()
        # token-weighted mean over the global batch: every rank divides by the same count
        counts = [(split_sample(mb, self.eod_mask_id)[1] != IGNORE_INDEX).sum() for mb in micro]
        n_tokens = torch.stack(counts).sum().to(torch.float64).reshape(1)  # on the device
        mappings.all_reduce(n_tokens, mesh.dp.group)
        tokens = float(cfg.train.global_batch_size * cfg.model.seq_length)  # a dry run's count
        (n_tokens,) = host.read(n_tokens, [tokens])
        lr = lr_at(self.step, cfg.train)
        set_lr(self.optimizer, lr)
        self.dp.start_step(len(micro))
        with self._phase("forward"):  # and the backward (the tracker tells them apart)
            loss_sum = self._measured_forward_backward(micro, 1.0 / n_tokens)
        with self._phase("grad sync", working=True):
            self.dp.finish_grad_sync()  # the buckets the backward did not already reduce
            # one world all-reduce for [Σg², loss sum, stop signals, activation changes]: the loss
            # lives on the last stage (tp rank 0 reports it), each CP rank holds a slice of the sum;
            # a rank that got a stop signal adds 1, so every rank agrees on stopping without a
            # collective of its own; likewise a rank whose activation peak changed since it was last
            # reduced (MoE routing) adds 1, so all redo the memory MAX all-reduce
            owner = self.holds_loss and mesh.tp.rank == 0
            grad_sq = self.dp.grad_square_sum()
            loss_part = loss_sum.reshape(()).double() if owner else torch.zeros_like(grad_sq)
            # a failed write of metrics.jsonl (rank 0) stops the run like a signal (train.py)
            signalled = float(self.signals.received is not None or self.logger.error is not None)
            changed = float(self._activations != self._activations_reduced)
            flags = [torch.full_like(grad_sq, signalled), torch.full_like(grad_sq, changed)]
            sums = torch.stack([grad_sq, loss_part, *flags])
            mappings.all_reduce(sums, dist.group.WORLD, kind="all_reduce_norm_loss")
        nominal = [1.0, n_tokens, 0.0, 0.0]  # a dry run's: unit norm, loss 1, no signals
        grad_sq, loss_total, signals, act_changes = host.read(sums, nominal)
        self.stop_requested = signals > 0
        grad_norm = grad_sq**0.5
        loss = loss_total / n_tokens
        # 1-based, as the progress line counts steps (metrics.jsonl's "step" is 0-based)
        skipped = self.guard.check(self.step + 1, loss, grad_norm, loss_part, self._named_grads)
        if skipped is None:
            with self._phase("optimizer", working=True):
                self.dp.clip(grad_norm, cfg.train.grad_clip)
                self.dp.step()  # AdamW on this rank's shards, then the weights all-gathered
            if self.memory_tracker is not None:  # the AdamW states exist from the first step
                self.memory_tracker.label_model_states(self.dp)
        elif dist.get_rank() == 0:
            print(skipped, flush=True)
        moe = self._moe_metrics(update_bias=skipped is None)
        self.state_guard.check(self.step + 1)  # before the step's checkpoint could store it
        if self.device.type == "cuda":  # the step's time includes its optimizer kernels
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.consumed_samples += cfg.train.global_batch_size
        global_tokens = cfg.train.global_batch_size * cfg.model.seq_length
        tflops = self.flops_per_step / dt / dist.get_world_size() / 1e12
        record = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": global_tokens / dt,
            "step_time_s": dt,
            "tflops_per_rank": tflops,
            **({"mfu": tflops / self.peak_tflops} if self.peak_tflops else {}),
            "consumed_samples": self.consumed_samples,
            **({"skipped": True} if skipped else {}),
            **self._step_memory(act_changes > 0),
            **moe,
            **STATS.summary(),
        }
        self.step += 1
        return record

    def _named_grads(self):
        """(name, reduced local gradient) for the non-finite guard (read only off the finite
        path): the wrapper's, since under ZeRO-2 `main_grad` has no storage after the sync."""
        names = {id(p): n for n, p in self.named_params}
        return [(names[id(g.param)], g.grad) for g in self.dp.local_grads()]

    def _step_memory(self, activations_changed: bool) -> dict[str, int]:
        """The step's mem/* figures (max over ranks). A tracked step (the run's first
        log.memory_steps, or a dry run's) measures the step's peak by category; the model states
        keep their shapes and a dense model's activations too, so later steps keep the last
        report (no collective per step) until some rank's activation peak changes (MoE
        routing; flagged in the step's SUM all-reduce); on CUDA the allocator's peaks change,
        so it is reduced every step."""
        tracker = self.memory_tracker
        if tracker is not None:
            self._step_peak = {**tracker.peak.by_category, "step_peak": tracker.peak.total}
        if (
            self._memory is None
            or tracker is not None
            or self.device.type == "cuda"
            or activations_changed
        ):
            self._memory = self.memory_report()
        last = self._tracked == self.cfg.log.memory_steps - 1
        if tracker is not None and last and dist.get_rank() == 0:
            print(self.peak_line(self._memory), flush=True)
        return self._memory

    @staticmethod
    def peak_line(mem: dict[str, int]) -> str:
        """The start-up report of the step's peak (rank 0 prints it after the tracked steps)."""
        parts = ", ".join(
            f"{k} {mem[f'mem/{k}'] / 2**20:.1f}" for k in CATEGORIES if mem.get(f"mem/{k}")
        )
        return (
            f"[memory] step peak per rank (max over ranks, MiB): {parts}; "
            f"total {mem['mem/step_peak'] / 2**20:.1f}"
        )

    def memory_report(self) -> dict[str, int]:
        """mem/<category>, max over ranks: after a tracked step the bytes of each category at
        the step's peak (weights, grads, master, optimizer, buffers, gathered, activations,
        temporaries) and mem/step_peak, the peak itself; before any, the model-state bytes as
        allocated (weights, grads, master, optimizer). Once a step has run also
        mem/activations_peak (the saved-tensor peak, see _measured_forward_backward); on CUDA
        also the allocator's peak allocated and reserved bytes over the run."""
        if self._step_peak is not None:
            names = [*CATEGORIES, "step_peak"]
            values = [float(self._step_peak[k]) for k in names]
        else:
            mem = self.dp.memory()
            names, values = list(TERMS), [float(mem[k]) for k in TERMS]
        if self._activations is not None:
            values.append(float(self._activations))
            names.append("activations_peak")
            self._activations_reduced = self._activations
        if self.device.type == "cuda":
            peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
            self._cuda_peaks = [max(a, b) for a, b in zip(self._cuda_peaks, peaks, strict=True)]
            values += self._cuda_peaks
            names += ["allocated_peak", "reserved_peak"]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        mappings.all_reduce(t, dist.group.WORLD, op=dist.ReduceOp.MAX, kind="all_reduce_mem")
        maxima = host.read(t, values)  # a dry run: this rank's own
        return {f"mem/{k}": int(v) for k, v in zip(names, maxima, strict=True)}

    def _measured_forward_backward(self, microbatches, loss_scale: float) -> torch.Tensor:
        """The step's forward and backward, measuring this rank's activation peak: on CPU the
        bytes saved for backward (SavedTensorMeter, parameters and buffers excluded; per layer
        in last_activation_report) on the run's first step and each step that ends a progress
        interval (log.interval), on CUDA the allocator's peak over the forward and backward
        minus the model-state bytes, every step."""
        if self.device.type == "cuda":
            self._cuda_peaks = [
                max(self._cuda_peaks[0], torch.cuda.max_memory_allocated()),
                max(self._cuda_peaks[1], torch.cuda.max_memory_reserved()),
            ]
            torch.cuda.reset_peak_memory_stats()
            loss_sum = self._forward_backward(microbatches, loss_scale)
            states = sum(self.dp.memory("cuda").values())  # not the offloaded host states
            self._activations = max(torch.cuda.max_memory_allocated() - states, 0)
            return loss_sum
        if self._activations is not None and not reports_at(self.step, self.cfg):
            # the meter's hooks cost ~5 ms a step: measure the run's first step and the steps
            # that end a progress interval; the others keep the last measurement
            return self._forward_backward(microbatches, loss_scale)
        buffers = [b for c in self.chunks for b in c.buffers()]  # RoPE tables: not activations
        with SavedTensorMeter(exclude=[*self.params, *buffers]) as meter:
            for chunk in self.chunks:
                meter.attach_labels(chunk)
            loss_sum = self._forward_backward(microbatches, loss_scale)
        self._activations = meter.peak_bytes
        self.last_activation_report = {
            "peak_bytes": meter.peak_bytes,
            "by_label": dict(meter.by_label),
            "recomputed_bytes": meter.recomputed_bytes,
            "num_microbatches": len(microbatches),
        }
        return loss_sum

    def _peak_tflops(self) -> float | None:
        """The GPU's peak dense bf16 TFLOP/s for mfu; None on CPU or an unknown GPU (said)."""
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name()
        try:
            return peak_tflops(name)
        except ValueError as e:
            if dist.get_rank() == 0:
                print(f"[metrics] no mfu: {e}", flush=True)
            return None

    def _moe_metrics(self, update_bias: bool) -> dict:
        """The step's MoE metrics (per layer at the end of a log interval); `update_bias`: the
        optimizer stepped, so the expert biases move by this step's global token counts (a
        skipped step leaves them)."""
        m, mesh = self.cfg.model, self.mesh
        if m.num_experts is None:
            return {}
        from megatron_lite.moe.layer import moe_metrics

        count_here = mesh.tp.rank == 0 and mesh.cp.rank == 0  # one rank per microbatch shard
        return moe_metrics(
            self.chunks,
            m.num_layers,
            m.num_experts,
            count_here,
            bool(m.moe_z_loss_coeff),
            expert_bias=m.moe_router_enable_expert_bias,
            update_bias=update_bias,
            per_layer=reports_at(self.step, self.cfg),
        )

    def _eval_due(self) -> bool:
        every = self.cfg.train.eval_interval
        return every > 0 and (self.step % every == 0 or self.step == self.cfg.train.steps)

    def train(self) -> list[dict]:
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
