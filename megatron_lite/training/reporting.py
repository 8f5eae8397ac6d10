"""What a step reports beside its loss: throughput and MFU, the mem/* figures, MoE metrics.

- `Throughput`: tokens/s, step time, model TFLOP/s per rank (training/flops.py's FLOPs per
  step, 6·N_active·T + attention, over the step time and the world size) and, on a GPU whose
  peak is known, MFU (that over the peak dense bf16 rate).
- `MemoryReport`: the mem/* figures of metrics.jsonl, max over ranks. The run's first
  log.memory_steps steps run under a MemoryTracker (`tracked`), whose peak by category
  (weights, grads, master, optimizer, buffers, gathered, activations, temporaries) and
  step_peak are reported; before any, the model-state bytes as allocated. `measure` wraps the
  forward and backward and records this rank's activation peak (mem/activations_peak): on CPU
  the bytes saved for backward (SavedTensorMeter, per layer in `last_activation_report`), on
  CUDA the allocator's peak minus the model states (and the run's allocated/reserved peaks).
  Reports are reduced only when something may have changed (see `step_memory`), so a dense
  model's later steps cost no collective.
- `MoEMetrics`: the MoE layers' metrics of a step (moe/layer.py), and dropping the statistics
  an evaluation gathered.
- `MTPMetrics`: the multi-token prediction loss of a step (models/mtp.py), `mtp_loss`.

Each is built from sizes, callables and the DP wrapper, without a Trainer (and, but for the
trainer's shortcut `MoEMetrics.of_model`, without a Config); tests/unit/test_reporting.py
checks them alone on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_lite.config import ModelConfig
from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.data_parallel.memory import TERMS
from megatron_lite.training.activation_memory import SavedTensorMeter
from megatron_lite.training.flops import peak_tflops
from megatron_lite.training.memory_tracker import CATEGORIES, MemoryTracker


def peak_tflops_of(device: torch.device, rank: int) -> float | None:
    """The GPU's peak dense bf16 TFLOP/s for mfu; None on CPU or an unknown GPU (rank 0 says
    so)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    try:
        return peak_tflops(name)
    except ValueError as e:
        if rank == 0:
            print(f"[metrics] no mfu: {e}", flush=True)
        return None


class Throughput:
    """A step's speed figures from its time: flops_per_step (model FLOPs of the global batch,
    training/flops.py), tokens_per_step (global batch · sequence length)."""

    def __init__(
        self, flops_per_step: float, tokens_per_step: int, world_size: int, peak: float | None
    ):
        self.flops_per_step, self.tokens_per_step = flops_per_step, tokens_per_step
        self.world_size, self.peak_tflops = world_size, peak

    def __call__(self, dt: float) -> dict[str, float]:
        """tokens_per_s, step_time_s, tflops_per_rank and (with a peak) mfu for a step of
        `dt` seconds."""
        tflops = self.flops_per_step / dt / self.world_size / 1e12
        return {
            "tokens_per_s": self.tokens_per_step / dt,
            "step_time_s": dt,
            "tflops_per_rank": tflops,
            **({"mfu": tflops / self.peak_tflops} if self.peak_tflops else {}),
        }


class MemoryReport:
    """The mem/* figures (module docstring). dp: the DataParallelWrapper (`memory()`: model
    states by term); chunks: the model chunks (their buffers, per-layer labels); params: the
    parameters (not activations); memory_steps: log.memory_steps; reports_at(step): the step
    ends a progress interval (the CPU meter runs then and on the first step); group: over which
    the maxima are taken."""

    def __init__(
        self,
        dp,
        chunks: list[torch.nn.Module],
        params: list[torch.Tensor],
        device: torch.device,
        memory_steps: int,
        reports_at: Callable[[int], bool],
        group=None,
    ):
        self.dp, self.chunks, self.params, self.device = dp, chunks, params, device
        self.memory_steps, self.reports_at = memory_steps, reports_at
        self.group = dist.group.WORLD if group is None else group
        self.tracker: MemoryTracker | None = None  # while a step is tracked (or a dry run's)
        self.tracked_steps = 0  # steps run under this report's own tracker
        self.last: dict[str, int] | None = None  # the mem/* of the steps (see step_memory)
        self.step_peak: dict[str, int] | None = None  # the last tracked step's peak
        self.activations: int | None = None  # this rank's activation peak of the last step
        self.activations_reduced: int | None = None  # ... as it was when last reduced
        self.cuda_peaks = [0, 0]  # allocated, reserved: the run's peaks (reset every step)
        # the step's saved-tensor report (CPU): peak_bytes, by_label, recomputed_bytes
        self.last_activation_report: dict | None = None

    def _buffers(self) -> list[torch.Tensor]:
        return [b for c in self.chunks for b in c.buffers()]

    @contextmanager
    def tracked(self) -> Iterator[None]:
        """Runs the body (a step) under a MemoryTracker when the run's first memory_steps are
        not done and no tracker is attached already (a dry run's); else just runs it."""
        if self.tracker is not None or self.tracked_steps >= self.memory_steps:
            yield
            return
        with MemoryTracker(self.device.type) as tracker:
            tracker.label_model_states(self.dp)
            tracker.label(self._buffers(), "buffers")
            self.tracker = tracker
            try:
                yield
            finally:
                self.tracker = None
                self.tracked_steps += 1

    def activations_changed(self) -> float:
        """1.0 when this rank's activation peak changed since it was last reduced (MoE
        routing): a flag for the step's SUM all-reduce, so that all ranks reduce again."""
        return float(self.activations != self.activations_reduced)

    def measure(
        self, forward_backward: Callable[[], torch.Tensor], num_microbatches: int, step: int
    ) -> torch.Tensor:
        """Runs the step's forward and backward, measuring this rank's activation peak: on
        CPU the bytes saved for backward (SavedTensorMeter, parameters and buffers excluded;
        per layer in last_activation_report) on the run's first step and each step that ends
        a progress interval, on CUDA the allocator's peak over the forward and backward minus
        the model-state bytes, every step."""
        if self.device.type == "cuda":
            self.cuda_peaks = [
                max(self.cuda_peaks[0], torch.cuda.max_memory_allocated()),
                max(self.cuda_peaks[1], torch.cuda.max_memory_reserved()),
            ]
            torch.cuda.reset_peak_memory_stats()
            loss_sum = forward_backward()
            states = sum(self.dp.memory("cuda").values())  # not the offloaded host states
            self.activations = max(torch.cuda.max_memory_allocated() - states, 0)
            return loss_sum
        if self.activations is not None and not self.reports_at(step):
            # the meter's hooks cost ~5 ms a step: measure the run's first step and the steps
            # that end a progress interval; the others keep the last measurement
            return forward_backward()
        # RoPE tables: not activations
        with SavedTensorMeter(exclude=[*self.params, *self._buffers()]) as meter:
            for chunk in self.chunks:
                meter.attach_labels(chunk)
            loss_sum = forward_backward()
        self.activations = meter.peak_bytes
        self.last_activation_report = {
            "peak_bytes": meter.peak_bytes,
            "by_label": dict(meter.by_label),
            "recomputed_bytes": meter.recomputed_bytes,
            "num_microbatches": num_microbatches,
        }
        return loss_sum

    def step_memory(self, activations_changed: bool) -> dict[str, int]:
        """The step's mem/* figures (max over ranks). A tracked step (the run's first
        memory_steps, or a dry run's) measures the step's peak by category; the model states
        keep their shapes and a dense model's activations too, so later steps keep the last
        report (no collective per step) until some rank's activation peak changes (MoE
        routing; flagged in the step's SUM all-reduce); on CUDA the allocator's peaks change,
        so it is reduced every step. Rank 0 prints the peak line after the last tracked step."""
        tracker = self.tracker
        if tracker is not None:
            self.step_peak = {**tracker.peak.by_category, "step_peak": tracker.peak.total}
        cuda = self.device.type == "cuda"
        if self.last is None or tracker is not None or cuda or activations_changed:
            self.last = self.report()
        last = self.tracked_steps == self.memory_steps - 1
        if tracker is not None and last and dist.get_rank() == 0:
            print(peak_line(self.last), flush=True)
        return self.last

    def report(self) -> dict[str, int]:
        """mem/<category>, max over ranks (a collective): after a tracked step the bytes of
        each category at the step's peak and mem/step_peak, the peak itself; before any, the
        model-state bytes as allocated (weights, grads, master, optimizer). Once a step has run
        also mem/activations_peak (see measure); on CUDA also the allocator's peak allocated
        and reserved bytes over the run."""
        if self.step_peak is not None:
            names = [*CATEGORIES, "step_peak"]
            values = [float(self.step_peak[k]) for k in names]
        else:
            mem = self.dp.memory()
            names, values = list(TERMS), [float(mem[k]) for k in TERMS]
        if self.activations is not None:
            values.append(float(self.activations))
            names.append("activations_peak")
            self.activations_reduced = self.activations
        if self.device.type == "cuda":
            peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
            self.cuda_peaks = [max(a, b) for a, b in zip(self.cuda_peaks, peaks, strict=True)]
            values += self.cuda_peaks
            names += ["allocated_peak", "reserved_peak"]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        mappings.all_reduce(t, self.group, op=dist.ReduceOp.MAX, kind="all_reduce_mem")
        maxima = host.read(t, values)  # a dry run: this rank's own
        return {f"mem/{k}": int(v) for k, v in zip(names, maxima, strict=True)}


def peak_line(mem: dict[str, int]) -> str:
    """The start-up report of the step's peak (rank 0 prints it after the tracked steps)."""
    parts = ", ".join(
        f"{k} {mem[f'mem/{k}'] / 2**20:.1f}" for k in CATEGORIES if mem.get(f"mem/{k}")
    )
    return (
        f"[memory] step peak per rank (max over ranks, MiB): {parts}; "
        f"total {mem['mem/step_peak'] / 2**20:.1f}"
    )


class MoEMetrics:
    """The MoE layers' step metrics (moe.layer.moe_metrics) for chunks holding MoE layers:
    num_layers, num_experts of the model; count_here: this rank counts its tokens (one rank
    per microbatch shard: tp rank 0, cp rank 0); with_z_loss: report the router z-loss;
    expert_bias: the routers carry an expert bias (moved by the step's token counts)."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        num_layers: int,
        num_experts: int,
        count_here: bool,
        *,
        with_z_loss: bool = False,
        expert_bias: bool = False,
    ):
        self.chunks, self.num_layers, self.num_experts = chunks, num_layers, num_experts
        self.count_here, self.with_z_loss, self.expert_bias = count_here, with_z_loss, expert_bias

    @classmethod
    def of_model(cls, m: ModelConfig, chunks: list[torch.nn.Module], mesh) -> MoEMetrics | None:
        """For the model config `m` (None for a dense model) on `mesh` (a ParallelMesh)."""
        if m.num_experts is None:
            return None
        return cls(
            chunks,
            m.num_layers + m.mtp_num_layers,  # the MTP modules' layers numbered after
            m.num_experts,
            mesh.tp.rank == 0 and mesh.cp.rank == 0,  # one rank per microbatch shard
            with_z_loss=bool(m.moe_z_loss_coeff),
            expert_bias=m.moe_router_enable_expert_bias,
        )

    def __call__(self, update_bias: bool, per_layer: bool) -> dict:
        """The step's metrics (a collective); update_bias: the optimizer stepped, so the
        expert biases move by this step's global token counts (a skipped step leaves them);
        per_layer: per-layer figures too (at the end of a log interval)."""
        from megatron_lite.moe.layer import moe_metrics

        return moe_metrics(
            self.chunks,
            self.num_layers,
            self.num_experts,
            self.count_here,
            self.with_z_loss,
            expert_bias=self.expert_bias,
            update_bias=update_bias,
            per_layer=per_layer,
        )

    def pop_stats(self) -> None:
        """Drops the routing statistics the layers gathered since the step (an evaluation's
        forward routes tokens too: they are not the step's)."""
        from megatron_lite.moe.layer import moe_layers

        for layer in moe_layers(self.chunks):
            layer.pop_stats()


class MTPMetrics:
    """The multi-token prediction loss of a step (models/mtp.py): `sums()` gives this rank's
    per-module loss sums [D] as 0-d device tensors for the step's world all-reduce (the
    `flags` of TrainStep.run: no collective of its own), nonzero on one rank per microbatch
    shard that holds the loss (tp rank 0; CP ranks hold parts of the sum, dp ranks their
    microbatches); `record(summed, tokens)` turns their world sums into the metrics: mtp_loss
    = (1/D) Σ_k Σ_i loss_k(i) / N (N: the main loss's global token count; without λ), and
    mtp_loss_<k> per module when D > 1."""

    def __init__(self, chunks: list[torch.nn.Module], num_layers: int, count_here: bool):
        self.modules = [c.mtp for c in chunks if getattr(c, "mtp", None) is not None]
        self.num_layers, self.count_here = num_layers, count_here

    @classmethod
    def of_model(cls, m: ModelConfig, chunks: list[torch.nn.Module], mesh) -> MTPMetrics | None:
        """For the model config `m` (None without MTP) on `mesh` (a ParallelMesh)."""
        if m.mtp_num_layers == 0:
            return None
        return cls(chunks, m.mtp_num_layers, mesh.tp.rank == 0)

    def sums(self) -> list[torch.Tensor | float]:
        """This rank's [D] loss sums since the last call (zeros where it does not count)."""
        got = [s for s in (m.pop_stats() for m in self.modules) if s is not None]
        if not got or not self.count_here:
            return [0.0] * self.num_layers
        return list(torch.stack(got).sum(0).unbind())

    def record(self, summed: list[float], tokens: float) -> dict:
        """The step's mtp_loss (and per module when D > 1) from the world sums."""
        per = [s / max(tokens, 1.0) for s in summed]
        out = {"mtp_loss": sum(per) / len(per)}
        if len(per) > 1:
            out.update({f"mtp_loss_{k}": v for k, v in enumerate(per, start=1)})
        return out

    def pop_stats(self) -> None:
        """Drops the sums an evaluation's forwards recorded (not the step's)."""
        for m in self.modules:
            m.pop_stats()
