"""Execute a pipeline schedule table over this rank's model chunks, for any model.

`forward_backward` (in the style of Megatron's `get_forward_backward_func`) walks
`comm_batches(get_schedule(pp, pp_rank, m, vpp))`: a forward of (microbatch, chunk) calls the
caller's `forward_step(chunk, microbatch, input)`, a backward runs autograd from what it
returned; each batch of sends/receives is one `P2PCommunicator.exchange`. pp = 1 runs the
`no_pipelining` table (gradient accumulation), so a trainer has one path for every layout. Per
(microbatch, chunk) it keeps the received input (a leaf that requires grad, so its .grad is what
send_backward ships), the output (hidden state, or the scaled loss on the last virtual stage)
and the received output grad, and frees them after that backward.

Pipeline memory (as Megatron's `deallocate_output_tensor`): once an output has been sent, its
data is freed and only its autograd graph stays until its backward (`deallocate_output`), so a
stage holds the saved tensors of its in-flight microbatches but not their outputs.
`PipelineStats` reports the most microbatches in flight and the most output bytes held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lite.parallel import linear_async, mappings
from megatron_lite.pipeline.p2p import P2PCommunicator, Posted
from megatron_lite.pipeline.schedules import (
    Action,
    comm_batches,
    get_schedule,
    get_schedule_spec,
    stage_location,
    virtual_stage,
)
from megatron_lite.pipeline.schedules import forward_only as forward_only_schedule
from megatron_lite.pipeline.trace import SpanRecorder

Key = tuple[int, int]  # (microbatch, chunk)
# forward_step(chunk, microbatch, input) -> the chunk's output activation, or on the last virtual
# stage a scalar loss; `input` is None on virtual stage 0 (the chunk reads the microbatch).
ForwardStep = Callable[[torch.nn.Module, Any, "torch.Tensor | None"], torch.Tensor]
# before_backward(chunk, is_last): called before each backward of local chunk `chunk`, outside
# autograd; is_last: the step's last backward of that chunk (from the schedule table), where a
# data-parallel wrapper that defers its gradient reduction (FSDP2) reduces. Under a split
# schedule a backward never completes the gradients (is_last is always False); then
# after_weight(chunk, is_last) follows each W of the chunk, is_last on its last W of the table
BeforeBackward = Callable[[int, bool], None]
AfterWeight = Callable[[int, bool], None]
# weight_phase(): a context manager entered around each W (a memory tracker names the phase)
WeightPhase = Callable[[], contextlib.AbstractContextManager]


@dataclass
class PipelineStats:
    """What one `forward_backward` held on this rank, filled in as it runs."""

    max_in_flight: int = 0  # most (microbatch, chunk) forwarded and not yet backwarded
    max_output_bytes: int = 0  # most bytes of those outputs' storages held at once
    freed_outputs: int = 0  # sent outputs whose data was freed (their graph kept)


def _saved_by_own_node(out: torch.Tensor) -> bool:
    """Whether `out`'s grad_fn saved its own result (a relu, say): then backward reads `out`'s
    data. Read from the node's attribute names, without unpacking anything."""
    return any(n.startswith("_saved_result") for n in dir(out.grad_fn))


def deallocate_output(out: torch.Tensor) -> bool:
    """Free the data of a sent output and keep its autograd graph: its data becomes one element
    expanded to its shape (stride 0), so `torch.autograd.backward(out, grad)` still sees the
    right shape and only the grad_fn is used. Skipped (False) for views (the base holds the
    data) and for outputs their own grad_fn saved. As in Megatron, a custom autograd Function
    that produces the output must not save it (its node's saves are not inspected)."""
    if out._base is not None or out.grad_fn is None or _saved_by_own_node(out):
        return False
    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)
    return True


def backward_follows(actions: Sequence[Action]) -> set[Key]:
    """The (microbatch, chunk) whose forward is followed by its own backward with no other
    forward in between (1F1B's last stage: every one; no pipelining: every one)."""
    compute = [a for a in actions if a.kind in ("forward", "backward")]
    return {
        (a.microbatch, a.chunk)
        for a, b in zip(compute, compute[1:], strict=False)
        if a.kind == "forward"
        and b.kind == "backward"
        and (a.microbatch, a.chunk) == (b.microbatch, b.chunk)
    }


class _Run:
    """State of one schedule execution on one rank."""

    def __init__(self, chunks, microbatches, forward_step, loss_scale, p2p, pp, dtype, recorder):
        self.chunks, self.microbatches, self.loss_scale = chunks, microbatches, loss_scale
        self.before_backward: BeforeBackward | None = None
        self.after_weight: AfterWeight | None = None
        self.weight_phase: WeightPhase = contextlib.nullcontext
        self.last_backward: dict[int, int] = {}  # chunk -> microbatch of its last backward
        self.last_weight: dict[int, int] = {}  # chunk -> microbatch of its last W (split)
        self.forward_step, self.p2p, self.dtype, self.recorder = forward_step, p2p, dtype, recorder
        self.pp_rank, self.pp_size, device = pp
        self.forward_only = False
        self.offloader = None  # an ActivationOffloader (parallel/activation_offload.py)
        self.backward_next: set[Key] = set()  # forwards whose backward is the next compute
        self.placement, self.posted, self.split = "loop", False, False
        self.last_stage = self.pp_size * len(chunks) - 1
        self.pending: dict[tuple[str, Key], Posted] = {}  # posted receives, by what they carry
        # posted batches with sends: (batch, its sends, the outputs they carry)
        self.posted_sends: list[tuple[Posted, list[Action], list[Key]]] = []
        self.wgrads: dict[Key, list] = {}  # deferred weight-gradient GEMMs, run by W
        self.live: set[Key] = set()  # forwarded, not yet through backward (W when split)
        self.inputs: dict[Key, torch.Tensor] = {}  # received activations (leaves)
        self.outputs: dict[Key, torch.Tensor] = {}  # hidden out, or scaled loss (last stage)
        self.output_grads: dict[Key, torch.Tensor] = {}  # received d(loss)/d(output)
        self.input_grads: dict[Key, torch.Tensor] = {}  # d(loss)/d(input), to send back
        self.total = torch.zeros((), dtype=torch.float64, device=device)  # unscaled loss sum
        self.stats = PipelineStats()
        # profiling on CUDA: spans must time the GPU work, not the kernel launches
        self.sync = torch.cuda.synchronize if recorder and device.type == "cuda" else None

    def stage(self, chunk: int) -> int:
        return virtual_stage(self.pp_rank, chunk, self.pp_size, self.placement)

    def local_chunk(self, stage: int) -> int | None:
        """This rank's chunk holding `stage` (the V turn), None if another rank holds it."""
        if not 0 <= stage <= self.last_stage:
            return None
        rank, chunk = stage_location(stage, self.pp_size, self.placement)
        return chunk if rank == self.pp_rank else None

    def arrived(self, kind: str, key: Key) -> None:
        """Posted batches: wait for the receive that carries `kind` of `key`, if one is out."""
        posted = self.pending.pop((kind, key), None)
        if posted is not None:
            action = Action(kind, *key)
            posted.wait(action)
            t = posted.received.pop(action)  # the batch may outlive it (a send still out)
            if kind == "recv_forward":
                self.inputs[key] = t.requires_grad_()
            else:
                self.output_grads[key] = t

    def forward(self, a: Action) -> None:
        key, stage = (a.microbatch, a.chunk), self.stage(a.chunk)
        prev = self.local_chunk(stage - 1)
        if prev is not None:  # the V turn: the previous stage's output, on this rank
            if self.forward_only:  # nothing of it is kept for a backward
                self.inputs[key] = self.outputs.pop((a.microbatch, prev))
            else:
                self.inputs[key] = self.outputs[(a.microbatch, prev)].detach().requires_grad_()
        x = None if stage == 0 else self.inputs[key]  # [s/cp(/tp), b, h] from the previous stage
        offload = self.offloader is not None and not self.forward_only
        with (
            (
                linear_async.defer_wgrad(self.chunks[a.chunk], self.wgrads.setdefault(key, []))
                if self.split and not self.forward_only
                else contextlib.nullcontext()
            ),
            (
                self.offloader.forward(key, key in self.backward_next)
                if offload
                else contextlib.nullcontext()
            ),
        ):
            out = self.forward_step(self.chunks[a.chunk], self.microbatches[a.microbatch], x)
        if self.forward_only:
            self.inputs.pop(key, None)
        if stage == self.last_stage:
            self.total += out.detach()
            if not self.forward_only:
                self.outputs[key] = out * self.loss_scale
        else:  # the wire dtype is fixed; a bf16 output is upcast exactly
            self.outputs[key] = out.to(self.dtype)
        if not self.forward_only:
            self.live.add(key)
            self.note_held()

    def note_held(self) -> None:
        st, held = self.stats, self.outputs.values()
        st.max_in_flight = max(st.max_in_flight, len(self.live))
        nbytes = sum(t.untyped_storage().nbytes() for t in held)
        st.max_output_bytes = max(st.max_output_bytes, nbytes)

    def backward(self, a: Action) -> None:
        key, stage = (a.microbatch, a.chunk), self.stage(a.chunk)
        out = self.outputs.pop(key)
        nxt = self.local_chunk(stage + 1)
        if nxt is not None:  # the V turn: the next stage's input grad, on this rank
            self.output_grads[key] = self.input_grads.pop((a.microbatch, nxt))
        grad = None if stage == self.last_stage else self.output_grads.pop(key)
        if self.before_backward is not None:  # split: the gradients are final after W
            last = not self.split and a.microbatch == self.last_backward[a.chunk]
            self.before_backward(a.chunk, last)
        if self.offloader is not None:  # its last offloaded layer starts coming back
            self.offloader.begin_backward(key)
        torch.autograd.backward(out, grad_tensors=grad)
        if stage != 0:
            inp = self.inputs.pop(key)
            if inp.grad is None:
                raise RuntimeError(f"{a}: the chunk's input got no gradient (is it used?)")
            self.input_grads[key] = inp.grad  # [s/cp(/tp), b, h]
        if not self.split:
            self.live.discard(key)

    def weight(self, a: Action) -> None:
        """W: the weight-gradient GEMMs the chunk's backward queued (the linear layers'), into
        main_grad / .grad; the activations they read are released with them."""
        key = (a.microbatch, a.chunk)
        with self.weight_phase():
            linear_async.run_wgrads(self.wgrads.pop(key, []))
        self.live.discard(key)
        if self.after_weight is not None:
            self.after_weight(a.chunk, a.microbatch == self.last_weight[a.chunk])

    def communicate(self, batch: tuple[Action, ...]) -> None:
        if self.posted and not self.forward_only:
            self.post(batch)
            return
        payload = {}
        for a in batch:
            key = (a.microbatch, a.chunk)
            if a.kind == "send_forward":  # kept for the backward unless forward-only
                out = self.outputs.pop(key) if self.forward_only else self.outputs[key]
                payload[a] = out.detach()
            elif a.kind == "send_backward":
                payload[a] = self.input_grads.pop(key)
        received = self.p2p.exchange(batch, payload)  # complete: the sent data may be freed
        if not self.forward_only:
            for a in batch:
                if a.kind == "send_forward":
                    out = self.outputs[(a.microbatch, a.chunk)]
                    self.stats.freed_outputs += deallocate_output(out)
        payload.clear()
        for a, t in received.items():
            key = (a.microbatch, a.chunk)
            if a.kind == "recv_forward":
                self.inputs[key] = t if self.forward_only else t.requires_grad_()
            else:
                self.output_grads[key] = t

    def post(self, batch: tuple[Action, ...]) -> None:
        """Posted batches: post and go on; receives are waited for by the compute that needs
        them, sends at the end (`settle`) or once they are seen done."""
        payload = {}
        for a in batch:
            key = (a.microbatch, a.chunk)
            if a.kind == "send_forward":
                payload[a] = self.outputs[key].detach()
            elif a.kind == "send_backward":
                payload[a] = self.input_grads.pop(key)
        posted = self.p2p.post(batch, payload)
        for a in batch:
            if not a.is_send:
                self.pending[(a.kind, (a.microbatch, a.chunk))] = posted
        sends = [a for a in batch if a.is_send]
        if sends:
            sent = [(a.microbatch, a.chunk) for a in sends if a.kind == "send_forward"]
            self.posted_sends.append((posted, sends, sent))
        self.settle(block=False)

    def settle(self, block: bool) -> None:
        """Free the outputs whose sends have landed (block: wait for every send first)."""
        keep = []
        for posted, sends, sent in self.posted_sends:
            if block:
                for a in sends:
                    posted.wait(a)
            elif not all([posted.landed(a) for a in sends]):
                keep.append((posted, sends, sent))
                continue
            for key in sent:  # the output's graph stays until its backward
                if key in self.outputs:
                    self.stats.freed_outputs += deallocate_output(self.outputs[key])
        self.posted_sends = keep

    def execute(self, step: Action | tuple[Action, ...]) -> None:
        if not isinstance(step, tuple) and step.kind in ("forward", "backward"):
            # posted batches: the wait for the input is idle time, not the compute's
            self.arrived("recv_" + step.kind, (step.microbatch, step.chunk))
        if self.sync:
            self.sync()
        start = self.recorder.now() if self.recorder else 0.0
        if isinstance(step, tuple):
            self.communicate(step)
        elif step.kind == "forward":
            self.forward(step)
        elif step.kind == "backward":
            self.backward(step)
        else:
            self.weight(step)
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
            "weight passes": self.wgrads,
            "receives": {k for _, k in self.pending},
        }
        left = {name: sorted(d) for name, d in held.items() if d}
        if left:
            raise RuntimeError(f"schedule finished with unconsumed tensors (mb, chunk): {left}")


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    microbatches: Sequence[Any],
    forward_step: ForwardStep,
    *,
    pp_group: dist.ProcessGroup | None = None,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    loss_scale: float = 1.0,
    timeout_s: float = 300.0,
    recorder: SpanRecorder | None = None,
    forward_only: bool = False,
    stats: PipelineStats | None = None,
    before_backward: BeforeBackward | None = None,
    after_weight: AfterWeight | None = None,
    weight_phase: WeightPhase | None = None,
    schedule: str | None = None,
    offloader=None,
) -> torch.Tensor:
    """Forward and backward of every microbatch through this rank's `chunks`; returns the sum of
    the unscaled losses `forward_step` returned (float64, 0-dim; zero unless this rank holds the
    last virtual stage). Backward runs on each loss times `loss_scale`.

    chunks[c] is virtual stage c·pp + pp_rank of `pp_group` (None or size 1: no pipelining,
    plain gradient accumulation); under the V placement (zb-v, dualpipev) chunks 0 and 1 are
    stages pp_rank and 2·pp − 1 − pp_rank. `tensor_shape`/`dtype` are the activation that
    crosses stages (every microbatch the same, e.g. `activation_shape(...)`); `timeout_s` bounds
    each send/recv batch (errors name rank, step, action and peer). `recorder` collects one span
    per action for a pipeline trace. `forward_only` (evaluation) runs the `forward_only` table
    under torch.no_grad(): no backward, no activation kept. `stats`, if given, is filled with
    what this rank held (`PipelineStats`). `before_backward(chunk, is_last)` runs before each
    backward, outside autograd, with is_last true for each chunk's last backward of the table
    (e.g. `DataParallelWrapper.before_backward`: FSDP2 reduces there, not in every backward).
    Under a split schedule every backward is announced with is_last false, and
    `after_weight(chunk, is_last)` runs after each W, is_last true for each chunk's last W
    (`DataParallelWrapper.after_weight`: FSDP2 reduces there, once every weight GEMM has run).
    `weight_phase()`, if given, is entered around each W (a memory tracker's phase: W runs
    outside autograd, and what it allocates is gradients and working memory, not activations).
    `schedule` names the table (a registered `ScheduleSpec`; None: 1F1B or interleaved by the
    chunk count), whose record gives the placement and how batches run. The zero-bubble ones
    split each backward: B runs autograd with the parallel linear layers' weight-gradient GEMMs
    queued (`linear_async.defer_wgrad`), W runs the queue; their batches are posted, each
    compute waiting only for the receive it needs. `offloader` (an `ActivationOffloader`)
    is told each forward's key and whether its backward is the rank's next compute (no
    forward in between, read from the table: its last layer is not offloaded) and each
    backward's key (its reload starts).
    """
    pp = mappings.size(pp_group)
    pp_rank = dist.get_rank(pp_group) if pp > 1 else 0
    device = device or torch.device("cpu")
    vpp = len(chunks)
    spec = get_schedule_spec(schedule, vpp)
    placement = spec.placement
    if forward_only:
        actions = forward_only_schedule(pp, pp_rank, len(microbatches), vpp, placement)
    else:
        actions = get_schedule(pp, pp_rank, len(microbatches), vpp, spec.name)
    p2p = None
    if pp > 1:
        if tensor_shape is None:
            raise ValueError("forward_backward: pp > 1 needs the tensor_shape that crosses stages")
        ranks = dist.get_process_group_ranks(pp_group)
        p2p = P2PCommunicator(
            pp_group, ranks, tensor_shape, dtype, device, timeout_s, placement=placement
        )
    pp_info = (pp_rank, pp, device)
    run = _Run(chunks, microbatches, forward_step, loss_scale, p2p, pp_info, dtype, recorder)
    run.forward_only = forward_only
    run.placement, run.posted = placement, spec.comm == "posted" and pp > 1
    run.split = any(a.kind == "weight" for a in actions)
    run.before_backward, run.after_weight = before_backward, after_weight
    if weight_phase is not None:
        run.weight_phase = weight_phase
    run.last_backward = {a.chunk: a.microbatch for a in actions if a.kind == "backward"}
    run.offloader, run.backward_next = offloader, backward_follows(actions)
    run.last_weight = {a.chunk: a.microbatch for a in actions if a.kind == "weight"}
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for step in comm_batches(actions):
            run.execute(step)
        run.settle(block=True)
    run.check_done()
    if stats is not None:
        stats.__dict__.update(run.stats.__dict__)
    return run.total
