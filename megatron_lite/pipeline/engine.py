"""Execute a pipeline schedule table over this rank's model chunks.

`run_schedule` walks `comm_batches(get_schedule(pp, pp_rank, m, vpp))`: forward/backward of
(microbatch, chunk) run on the chunk; each batch of sends/receives is one
`P2PCommunicator.exchange`. Per (microbatch, chunk) it keeps the received input (a leaf that
requires grad, so its .grad is what send_backward ships), the output (hidden state, or the
scaled loss sum on the last virtual stage) and the received output grad, and frees them after
that backward. `forward_backward_pipelining` is the Trainer's entry point; `run_schedule` takes
plain chunks, so models outside the trainer can use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_lite.parallel import mappings
from megatron_lite.pipeline.p2p import P2PCommunicator, activation_shape, pipeline_dtype
from megatron_lite.pipeline.schedules import Action, comm_batches, get_schedule
from megatron_lite.pipeline.trace import SpanRecorder, write_trace

Key = tuple[int, int]  # (microbatch, chunk)


class _Run:
    """State of one schedule execution on one rank."""

    def __init__(self, chunks, microbatches, loss_scale, p2p, autocast, recorder):
        self.chunks, self.microbatches, self.loss_scale = chunks, microbatches, loss_scale
        self.p2p, self.autocast, self.recorder = p2p, autocast, recorder
        self.inputs: dict[Key, torch.Tensor] = {}  # received activations (leaves)
        self.outputs: dict[Key, torch.Tensor] = {}  # hidden out, or scaled loss (last stage)
        self.output_grads: dict[Key, torch.Tensor] = {}  # received d(loss)/d(output)
        self.input_grads: dict[Key, torch.Tensor] = {}  # d(loss)/d(input), to send back
        device = p2p.device
        self.total = torch.zeros((), dtype=torch.float64, device=device)  # unscaled loss sum
        # profiling on CUDA: spans must time the GPU work, not the kernel launches
        self.sync = torch.cuda.synchronize if recorder and device.type == "cuda" else None

    def forward(self, a: Action) -> None:
        key, chunk = (a.microbatch, a.chunk), self.chunks[a.chunk]
        mb = self.microbatches[a.microbatch]  # token ids [b, s + 1]
        x = mb[:, :-1] if chunk.pre_process else self.inputs[key]  # ids [b, s] | [s/cp(/tp), b, h]
        labels = mb[:, 1:] if chunk.post_process else None  # [b, s]
        with self.autocast():
            out = chunk(x, labels)  # loss [s/cp, b] on the last stage, else [s/cp(/tp), b, h]
        if chunk.post_process:
            loss = out.sum()
            self.total += loss.detach()
            self.outputs[key] = loss * self.loss_scale
        else:  # the wire dtype is fixed (p2p.pipeline_dtype); a bf16 output is upcast exactly
            self.outputs[key] = out.to(self.p2p.dtype)

    def backward(self, a: Action) -> None:
        key, chunk = (a.microbatch, a.chunk), self.chunks[a.chunk]
        out = self.outputs.pop(key)
        grad = None if chunk.post_process else self.output_grads.pop(key)
        torch.autograd.backward(out, grad_tensors=grad)
        if not chunk.pre_process:
            inp = self.inputs.pop(key)
            if inp.grad is None:
                raise RuntimeError(f"{a}: the chunk's input got no gradient (is it used?)")
            self.input_grads[key] = inp.grad  # [s/cp(/tp), b, h]

    def communicate(self, batch: tuple[Action, ...]) -> None:
        payload = {}
        for a in batch:
            key = (a.microbatch, a.chunk)
            if a.kind == "send_forward":
                payload[a] = self.outputs[key].detach()
            elif a.kind == "send_backward":
                payload[a] = self.input_grads.pop(key)
        for a, t in self.p2p.exchange(batch, payload).items():
            key = (a.microbatch, a.chunk)
            if a.kind == "recv_forward":
                self.inputs[key] = t.requires_grad_()
            else:
                self.output_grads[key] = t

    def execute(self, step: Action | tuple[Action, ...]) -> None:
        if self.sync:
            self.sync()
        start = self.recorder.now() if self.recorder else 0.0
        if isinstance(step, tuple):
            self.communicate(step)
        elif step.kind == "forward":
            self.forward(step)
        else:
            self.backward(step)
        if self.recorder:
            if self.sync:
                self.sync()
            end = self.recorder.now()
            for a in step if isinstance(step, tuple) else (step,):
                self.recorder.add(a.kind, a.microbatch, a.chunk, start, end)

    def check_done(self) -> None:
        held = {
            "inputs": self.inputs,
            "outputs": self.outputs,
            "output grads": self.output_grads,
            "input grads": self.input_grads,
        }
        left = {name: sorted(d) for name, d in held.items() if d}
        if left:
            raise RuntimeError(f"schedule finished with unconsumed tensors (mb, chunk): {left}")


def run_schedule(
    chunks: Sequence[torch.nn.Module],
    microbatches: Sequence[torch.Tensor],
    loss_scale: float,
    p2p: P2PCommunicator,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    recorder: SpanRecorder | None = None,
) -> torch.Tensor:
    """Forward and backward of every microbatch through the pipeline; returns the summed
    unscaled per-token loss (float64, 0-dim; zero unless this rank holds the last stage).

    chunks[c] is virtual stage c·pp + pp_rank, with `pre_process`/`post_process` flags and
    forward(x, labels); microbatches are token ids [b, s + 1]; backward runs on the loss sum
    times `loss_scale`.
    """
    actions = get_schedule(p2p.pp_size, p2p.pp_rank, len(microbatches), len(chunks))
    run = _Run(chunks, microbatches, loss_scale, p2p, autocast, recorder)
    for step in comm_batches(actions):
        run.execute(step)
    run.check_done()
    return run.total


def forward_backward_pipelining(trainer, microbatches, loss_scale: float) -> torch.Tensor:
    """The Trainer's pp > 1 step: `run_schedule` over `trainer.chunks`, with the trainer's
    autocast, the mesh's pipeline group and, under train.profile_pipeline, a trace file."""
    from megatron_lite.training.trainer import autocast

    cfg, mesh = trainer.cfg, trainer.mesh
    sp = cfg.parallel.sequence_parallel
    shape = activation_shape(
        cfg.model.seq_length,
        cfg.train.micro_batch_size,
        cfg.model.hidden_size,
        mesh.cp_size,
        mesh.tp_size,
        sp,
    )
    p2p = P2PCommunicator(
        mesh.pp_group,
        mesh.pp_ranks,
        shape,
        pipeline_dtype(cfg.train.precision),
        trainer.device,
        cfg.parallel.timeout_s,
    )
    recorder = None
    if cfg.train.profile_pipeline:  # a common time origin for all ranks' spans
        mappings.all_reduce(
            torch.zeros(1, device=trainer.device), dist.group.WORLD, kind="profile_sync"
        )
        recorder = SpanRecorder()
    total = run_schedule(
        trainer.chunks,
        microbatches,
        loss_scale,
        p2p,
        lambda: autocast(cfg, trainer.device),
        recorder,
    )
    if recorder is not None:
        meta = {
            "pp": mesh.pp_size,
            "vpp": len(trainer.chunks),
            "step": trainer.step,
            "num_microbatches": len(microbatches),
            "world_size": dist.get_world_size(),
        }
        write_trace(recorder, mesh.pp_rank, meta, cfg.train.out_dir)
    return total
