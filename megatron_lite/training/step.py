"""The training step (Megatron's `train_step`): one global batch's microbatches forward and
backward through the pipeline engine, gradient finalization, the non-finite guard, clipping and
the optimizer step.

`TrainStep` is built from the model chunks, their data-parallel wrapper (`DataParallelWrapper`:
reduction, Σg², clipping, the optimizer), the mesh, a forward step (the engine's
`forward_step(chunk, microbatch, input)`) and a `PipelineArgs` of sizes; it reads no Config and
holds no Trainer, so it runs any chunks (tests/unit/test_train_step.py steps a plain torch model
and checks it against torch.optim.AdamW). Per step, in order:

1. the global token count (Σ over the dp ranks of the labels that are not IGNORE_INDEX): the
   loss is the token-weighted mean over the global batch, so every rank scales by 1/count;
2. forward and backward of every microbatch (`forward_backward`: any schedule, pp = 1 runs no
   pipelining), wrapped by the caller's `measure` (the activation meter, see reporting.py);
3. the wrapper's last gradient reductions, then ONE world all-reduce of [Σg², loss sum, the
   caller's flags]: the loss lives on the last stage (tp rank 0 reports it), each CP rank holds
   a slice of the sum, and a flag (a stop signal, a changed activation peak) summed with the
   others costs no collective of its own;
4. under train.rerun_on, a suspicious step (non-finite, or a spike) replays steps 2-3 once
   (rerun.py), restoring the RNG states kept before step 2;
5. the non-finite guard on the reduced loss and norm (skip or stop: nonfinite.py), else
   clipping and the optimizer step.

The two host reads (steps 1 and 3) are dry-run seams (parallel/dry_run_seams.py): on fake
tensors they answer the full token count, unit norm, loss 1 and no flags.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite import resolve
from megatron_lite.config import Config
from megatron_lite.data.sampler import split_sample
from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.activation_offload import ActivationOffloader
from megatron_lite.parallel.cross_entropy import IGNORE_INDEX
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.pipeline.engine import ForwardStep, forward_backward
from megatron_lite.pipeline.p2p import activation_shape, pipeline_dtype
from megatron_lite.pipeline.schedules import resolve_schedule
from megatron_lite.pipeline.trace import SpanRecorder, write_trace
from megatron_lite.training.lm_step import lm_forward_step
from megatron_lite.training.memory_tracker import MemoryTracker
from megatron_lite.training.nonfinite import NonFiniteGuard
from megatron_lite.training.optimizer import set_lr
from megatron_lite.training.rerun import Attempt, StepRerun

# (a thunk running the step's forward and backward -> its loss sum, number of microbatches)
Measure = Callable[[Callable[[], torch.Tensor], int], torch.Tensor]


@dataclass(frozen=True)
class PipelineArgs:
    """What the pipeline engine needs besides the chunks: the activation passed between stages
    (shape [s/cp(/tp), b, h] and dtype), the schedule's name, the P2P timeout, and where to
    write a pipeline trace per step (train.profile_pipeline; None: no trace)."""

    tensor_shape: tuple[int, ...]
    dtype: torch.dtype
    schedule: str
    timeout_s: float
    trace_dir: str | None = None


def pipeline_args(cfg: Config, mesh: ParallelMesh) -> PipelineArgs:
    """The run's PipelineArgs (a trace only under train.profile_pipeline with pp > 1)."""
    m, t = cfg.model, cfg.train
    shape = activation_shape(
        m.seq_length,
        t.micro_batch_size,
        m.hidden_size,
        mesh.cp.size,
        mesh.tp.size,
        cfg.parallel.sequence_parallel,
    )
    return PipelineArgs(
        tensor_shape=shape,
        dtype=pipeline_dtype(t.precision, m.fp32_residual_connection),
        schedule=cfg.parallel.pipeline_schedule,
        timeout_s=cfg.parallel.timeout_s,
        trace_dir=t.out_dir if t.profile_pipeline and mesh.pp.size > 1 else None,
    )


@dataclass
class StepResult:
    """The reduced loss (token-weighted mean) and gradient norm of a step, the guard's warning
    when it was skipped (None: the optimizer stepped), the world sums of the flags, and the
    global token count."""

    loss: float
    grad_norm: float
    skipped: str | None
    flags: list[float]
    tokens: float = 0.0  # the global token count the loss is the mean over


class TrainStep:
    """One optimizer step over a global batch's microbatches (module docstring).

    chunks: this rank's model chunks (virtual stages); dp: their DataParallelWrapper;
    forward_step: the engine's forward step; holds_loss: this rank runs the last virtual stage
    (where the loss is); eod_mask_id: split_sample's (data.eod_mask_loss), for the token count;
    named_params: (name, parameter) of the chunks, for the guard's message; memory_tracker:
    returns the MemoryTracker that names the step's phases, or None (no tracking); rerun: the
    replay of a suspicious step (rerun.py; None or inactive: none), before_replay: drops
    what the first run's forward recorded outside the gradients (MoE routing statistics);
    offloader: the chunks' ActivationOffloader (model.activation_offload), or None."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        dp,
        mesh: ParallelMesh,
        forward_step: ForwardStep,
        pipeline: PipelineArgs,
        device: torch.device,
        *,
        holds_loss: bool,
        eod_mask_id: int | None = None,
        grad_clip: float,
        guard: NonFiniteGuard,
        named_params: list[tuple[str, torch.nn.Parameter]],
        memory_tracker: Callable[[], MemoryTracker | None] = lambda: None,
        rerun: StepRerun | None = None,
        before_replay: Callable[[], None] = lambda: None,
        offloader: ActivationOffloader | None = None,
    ):
        self.chunks, self.dp, self.mesh, self.device = chunks, dp, mesh, device
        self.offloader = offloader
        self.rerun = rerun if rerun is not None and rerun.active else None
        self.before_replay = before_replay  # drops what the first run's forward recorded
        # a test's fault injection: called with (step, replay) after the gradient reduction
        self.after_grad_sync: Callable[[int, bool], None] | None = None
        self.forward_step, self.pipeline = forward_step, pipeline
        self.grad_clip, self.guard, self.memory_tracker = grad_clip, guard, memory_tracker
        self.holds_loss, self.eod_mask_id = holds_loss, eod_mask_id
        self.names = {id(p): n for n, p in named_params}

    def phase(self, name: str, working: bool = False):
        """The tracker's phase `name` (working: new storages are temporaries), if tracked."""
        t = self.memory_tracker()
        return t.phase(name, working) if t is not None else contextlib.nullcontext()

    def forward_backward(
        self,
        microbatches: list[torch.Tensor],
        loss_scale: float,
        forward_only: bool = False,
        step: int = 0,
    ) -> torch.Tensor:
        """The sum of the microbatches' unscaled losses on the loss stage (the engine's);
        gradients of loss·loss_scale accumulated unless forward_only. `step`: the trace's."""
        p, mesh = self.pipeline, self.mesh
        recorder = None if forward_only else self._pipeline_recorder()
        total = forward_backward(
            self.chunks,
            microbatches,
            self.forward_step,
            pp_group=mesh.pp.group,
            tensor_shape=p.tensor_shape,
            dtype=p.dtype,
            device=self.device,
            loss_scale=loss_scale,
            timeout_s=p.timeout_s,
            recorder=recorder,
            forward_only=forward_only,
            before_backward=self.dp.before_backward,
            after_weight=self.dp.after_weight,
            weight_phase=lambda: self.phase("weight", working=True),
            schedule=p.schedule,
            offloader=None if forward_only else self.offloader,
        )
        if recorder is not None:
            meta = {
                "pp": mesh.pp.size,
                "vpp": len(self.chunks),
                "step": step,
                "num_microbatches": len(microbatches),
                "schedule": resolve_schedule(p.schedule, len(self.chunks)),
                "world_size": dist.get_world_size(),
            }
            write_trace(recorder, mesh.pp.rank, meta, p.trace_dir)
        return total

    def _pipeline_recorder(self) -> SpanRecorder | None:
        """With a trace_dir: a span recorder with a common time origin over the world."""
        if self.pipeline.trace_dir is None:
            return None
        mappings.all_reduce(
            torch.zeros(1, device=self.device), dist.group.WORLD, kind="profile_sync"
        )
        if self.device.type == "cuda":  # NCCL returns once queued: wait until every rank is in
            torch.cuda.synchronize()
        return SpanRecorder()

    def token_counts(self, microbatches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per microbatch, its labels that count (not IGNORE_INDEX): 0-d tensors, on the device."""
        eod = self.eod_mask_id
        return [(split_sample(mb, eod)[1] != IGNORE_INDEX).sum() for mb in microbatches]

    def global_tokens(self, counts: list[torch.Tensor], microbatches: list[torch.Tensor]) -> float:
        """The microbatches' token counts summed over the global batch (all dp ranks)."""
        n_tokens = torch.stack(counts).sum().to(torch.float64).reshape(1)  # on the device
        mappings.all_reduce(n_tokens, self.mesh.dp.group)
        # a dry run's count: every label of the global batch ([b, s + 1] samples)
        every = sum(mb.shape[0] * (mb.shape[1] - 1) for mb in microbatches) * self.mesh.dp.size
        (n_tokens,) = host.read(n_tokens, [float(every)])
        return n_tokens

    def run(
        self,
        microbatches: list[torch.Tensor],
        lr: float,
        step: int,
        *,
        flags: Callable[[], list[float]] = list,
        measure: Measure | None = None,
    ) -> StepResult:
        """Step `step` (0-based) at learning rate `lr`. flags(): this rank's numbers (floats,
        or 0-d tensors on the device: no host read) summed over the world with the norm and
        loss, read after the backward; measure: wraps the forward and backward (default: runs
        it)."""
        counts = self.token_counts(microbatches)  # alive for the step: its mem/* count them
        n_tokens = self.global_tokens(counts, microbatches)
        set_lr(self.dp.optimizer, lr)
        saved = self.rerun.capture() if self.rerun is not None else None
        attempt = self._attempt(microbatches, n_tokens, step, flags, measure)
        if self.rerun is not None:

            def replay() -> Attempt:
                self.rerun.restore(saved)
                self.before_replay()
                return self._attempt(microbatches, n_tokens, step, flags, None, replay=True)

            attempt = self.rerun.check(step + 1, attempt, replay)
        loss, grad_norm = attempt.loss, attempt.grad_norm
        # 1-based, as the progress line counts steps (metrics.jsonl's "step" is 0-based)
        local_loss = attempt.local[1]
        skipped = self.guard.check(step + 1, loss, grad_norm, local_loss, self._named_grads)
        if skipped is None:
            with self.phase("optimizer", working=True):
                self.dp.clip(grad_norm, self.grad_clip)
                self.dp.step()  # the optimizer on this rank's shards, then the weights gathered
            tracker = self.memory_tracker()
            if tracker is not None:  # the optimizer states exist from the first step
                tracker.label_model_states(self.dp)
        elif dist.get_rank() == 0:
            print(skipped, flush=True)
        return StepResult(loss, grad_norm, skipped, attempt.flags, n_tokens)

    def _attempt(
        self,
        microbatches: list[torch.Tensor],
        n_tokens: float,
        step: int,
        flags: Callable[[], list[float]],
        measure: Measure | None,
        replay: bool = False,
    ) -> Attempt:
        """The step up to the optimizer: gradients zeroed, forward and backward, the last
        reductions and the world all-reduce of [Σg², loss sum, flags] (run twice when a
        suspicious step is replayed: rerun.py)."""
        if self.offloader is not None:
            self.offloader.reset()  # its stats are this attempt's
        self.dp.start_step(len(microbatches))
        measure = measure or (lambda run, _n: run())
        with self.phase("forward"):  # and the backward (the tracker tells them apart)
            loss_sum = measure(
                lambda: self.forward_backward(microbatches, 1.0 / n_tokens, step=step),
                len(microbatches),
            )
        with self.phase("grad sync", working=True):
            self.dp.finish_grad_sync()  # the buckets the backward did not already reduce
            if self.after_grad_sync is not None:
                self.after_grad_sync(step, replay)
            owner = self.holds_loss and self.mesh.tp.rank == 0
            grad_sq = self.dp.grad_square_sum()
            loss_part = loss_sum.reshape(()).double() if owner else torch.zeros_like(grad_sq)
            extra = [_flag(f, grad_sq) for f in flags()]
            sums = torch.stack([grad_sq, loss_part, *extra])
            mappings.all_reduce(sums, dist.group.WORLD, kind="all_reduce_norm_loss")
        nominal = [1.0, n_tokens, *[0.0] * len(extra)]  # a dry run's: unit norm, loss 1
        grad_sq_total, loss_total, *flag_sums = host.read(sums, nominal)
        local = (grad_sq, loss_part)
        return Attempt(loss_total / n_tokens, grad_sq_total**0.5, local, flag_sums)

    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """(name, reduced local gradient) for the non-finite guard (read only off the finite
        path): the wrapper's, since under ZeRO-2 `main_grad` has no storage after the sync."""
        return [(self.names[id(g.param)], g.grad) for g in self.dp.local_grads()]


def _flag(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A flag as a 0-d tensor of `like`'s dtype and device."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(like)
    return torch.full_like(like, value)


def lm_train_step(
    cfg: Config,
    mesh: ParallelMesh,
    chunks: list[torch.nn.Module],
    dp,
    device: torch.device,
    *,
    guard: NonFiniteGuard,
    memory_tracker: Callable[[], MemoryTracker | None] = lambda: None,
    rerun: StepRerun | None = None,
    before_replay: Callable[[], None] = lambda: None,
) -> TrainStep:
    """The trainer's TrainStep: our language model's forward step (lm_step.py) on `chunks`
    (ModelChunks: the one whose `post_process` is set holds the loss), sized by `cfg`."""
    eod_mask_id = resolve.eod_mask_id(cfg.data)
    return TrainStep(
        chunks,
        dp,
        mesh,
        lm_forward_step(cfg.train.precision, device, eod_mask_id),
        pipeline_args(cfg, mesh),
        device,
        # the last virtual stage (the loss): the last pipeline rank, or the first under the V
        # placement (zb-v, dualpipev)
        holds_loss=any(c.post_process for c in chunks),
        eod_mask_id=eod_mask_id,
        grad_clip=cfg.train.grad_clip,
        guard=guard,
        named_params=[(n, p) for c in chunks for n, p in c.named_parameters()],
        memory_tracker=memory_tracker,
        rerun=rerun,
        before_replay=before_replay,
        offloader=build_offloader(cfg, chunks, device, memory_tracker),
    )


def build_offloader(
    cfg: Config,
    chunks: list[torch.nn.Module],
    device: torch.device,
    memory_tracker: Callable[[], MemoryTracker | None] = lambda: None,
) -> ActivationOffloader | None:
    """The ActivationOffloader of model.activation_offload hooked on the layers of each chunk
    (its `layers` ModuleDict, in order), or None when the list is empty; its host copies are
    named to the memory tracker when one runs (host bytes, out of the device's)."""

    def on_host(tensors: list[torch.Tensor]) -> None:
        tracker = memory_tracker()
        if tracker is not None:
            tracker.offloaded_to_host(tensors)

    def host_scope():
        tracker = memory_tracker()
        return tracker.host_allocations() if tracker is not None else contextlib.nullcontext()

    m = cfg.model
    if not m.activation_offload:
        return None
    offloader = ActivationOffloader(
        m.activation_offload,
        min_bytes=m.activation_offload_min_bytes,
        inflight=m.activation_offload_inflight,
        device=device,
        on_host=on_host,
        host_scope=host_scope,
    )
    offloader.attach([list(getattr(c, "layers", {}).values()) for c in chunks])
    return offloader
