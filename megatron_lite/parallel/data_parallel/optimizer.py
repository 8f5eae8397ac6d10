"""The optimizer (an `OptimizerSpec`, optimizer_spec.py; AdamW by default) over this rank's
shards of the gradient buffers, with fp32 master weights (Megatron's distributed optimizer;
ZeRO-0 is the same with one shard per rank holding everything).

Each (parameter ∩ this rank's shard) range is one piece: its master weight (the fp32 parameter
data itself when the model is fp32 and the state stays on the device; else an fp32 copy, on the
host under optimizer offload) and its gradient (a view of the reduced fp32 `main_grad` shard).
The spec's torch optimizer steps the pieces (AdamW: per tensor on CPU, so every layout does the
same arithmetic per element; fused on CUDA), then the updated masters are written back into the
parameters' shards and the buffers all-gather them (ZeRO-1/2). A spec whose update needs whole
matrices gets whole parameters as pieces instead (whole_matrix.py). Under NVMe offload the
masters and states live in a swap file and are read in group by group for the step (nvme.py).

Offload on CUDA (`_Transfers`): the copies between the device and the pinned host masters run
on a copy stream with non_blocking=True and are ordered by events, never by synchronizing a
whole stream. The copy stream waits for an event recorded on the compute stream (the reduced,
clipped gradients are final), copies the gradients to pinned host memory and records
`grads_on_host`; the host waits for that event alone, and for `params_on_device` of the step
before (whose copies still read the masters it is about to overwrite), then steps AdamW. The
updated masters go back the same way (the copy stream first waits for the compute stream, which
may still read the old weights), and the compute stream waits for `params_on_device` before
anything after the step (the all-gather, the next forward) reads them; the host never waits for
the device there. On a CPU run the host is the device: the events are no-ops and the copies the
plain ones, so the results are bitwise those of a run without offload ordering.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_lite.parallel import fake, mappings
from megatron_lite.parallel.data_parallel.buffers import GradBuffer
from megatron_lite.parallel.data_parallel.interface import StateShard
from megatron_lite.parallel.data_parallel.nvme import NvmeSettings, NvmeStates
from megatron_lite.parallel.data_parallel.optimizer_spec import (
    OptimizerSpec,
    init_states,
    make_optimizer,
    tensor_groups,
)


@dataclass
class Piece:
    buffer: GradBuffer
    param: torch.nn.Parameter
    lo: int  # [lo, hi) in the buffer (inside the parameter's range and this rank's shard)
    hi: int
    grad_at: int  # where [lo, hi) starts in buffer.grad_shard
    master: torch.nn.Parameter  # fp32: flat, or the parameter's shape for a whole one
    aliased: bool  # the master is the parameter's fp32 data itself (not a copy)
    owned: bool = False  # a whole parameter this rank alone updates (whole_matrix.py)
    swapped: bool = False  # NVMe offload: the master is empty between steps (nvme.py)

    @property
    def shape(self) -> tuple[int, ...]:
        """The master's shape: flat, or the parameter's for a whole one."""
        return (self.hi - self.lo,) if self.swapped else tuple(self.master.shape)

    @property
    def param_slice(self) -> torch.Tensor:
        return self.buffer.param_data[self.lo : self.hi].view(self.shape)

    @property
    def grad(self) -> torch.Tensor:
        flat = self.buffer.grad_shard[self.grad_at : self.grad_at + self.hi - self.lo]
        return flat.view(self.shape)

    def offset(self) -> int:
        """Where the piece starts inside its parameter (flattened)."""
        return self.lo - self.buffer.ranges[id(self.param)].start


def make_pieces(buffers: list[GradBuffer], offload: str) -> list[Piece]:
    """One piece per (parameter ∩ this rank's shard) of `buffers`; `offload` "none", "cpu"
    (masters copied to the host) or "nvme" (empty masters: the swap file holds them)."""
    pieces = []
    for buf in buffers:
        for _, (a, e), (c, _) in buf.shard_slices():
            for r in buf.ranges.values():
                lo, hi = max(a, r.start), min(e, r.start + r.param.numel())
                if lo >= hi:
                    continue
                data = buf.param_data[lo:hi]
                copy = data.dtype != torch.float32 or offload != "none"
                if offload == "nvme":  # written to the swap file by ShardedOptimizer
                    data = torch.empty(0, dtype=torch.float32)
                elif copy:
                    host = torch.device("cpu") if offload == "cpu" else data.device
                    data = data.to(host, torch.float32, copy=True)
                    if offload == "cpu" and torch.cuda.is_available():
                        data = data.pin_memory()
                master = torch.nn.Parameter(data)
                at, nvme = c + lo - a, offload == "nvme"
                pieces.append(Piece(buf, r.param, lo, hi, at, master, not copy, swapped=nvme))
    return pieces


class _NoEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _HostOps:
    """Streams and events where the host is the device (CPU, a dry run): none, copies in place."""

    def event(self):
        return _NoEvent()

    def current_stream(self):
        return None

    def new_stream(self):
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def wait_event(self, stream, event) -> None:
        pass

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=True)  # already there: `t` itself, no copy

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


class _CudaOps(_HostOps):
    """CUDA streams and events; host copies land in pinned memory (asynchronous)."""

    def event(self):
        return torch.cuda.Event()

    def current_stream(self):
        return torch.cuda.current_stream()

    def new_stream(self):
        return torch.cuda.Stream()

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class _Transfers:
    """Optimizer offload's copies of `pieces` between the device and the host, ordered by
    events on a copy stream (module docstring). `ops`: `_CudaOps()`, `_HostOps()`, or a test's
    stand-in that records the order of records, waits and copies."""

    def __init__(self, pieces: list[Piece], ops: _HostOps):
        self.pieces, self.ops = pieces, ops
        self.copy_stream = ops.new_stream()
        self.grads_on_host = None  # events recorded on the copy stream after its copies
        self.params_on_device = None

    def _after_compute(self) -> None:
        """The copy stream waits for what the compute stream has queued so far."""
        ready = self.ops.event()
        ready.record(self.ops.current_stream())
        self.ops.wait_event(self.copy_stream, ready)

    def grads_to_host(self) -> None:
        """Each piece's `master.grad` <- its gradient shard, in host memory; then the host waits
        for those copies and for the last step's copies out of the masters."""
        self._after_compute()
        with self.ops.stream(self.copy_stream):
            for pc in self.pieces:
                pc.master.grad = self.ops.to_host(pc.grad)
        self.grads_on_host = self.ops.event()
        self.grads_on_host.record(self.copy_stream)
        for event in (self.params_on_device, self.grads_on_host):
            if event is not None:
                event.synchronize()  # this event only, not the streams

    def params_to_device(self) -> None:
        """The parameters' shards <- the updated masters; later compute-stream work waits."""
        self._after_compute()
        with self.ops.stream(self.copy_stream):
            for pc in self.pieces:
                if not pc.aliased:
                    self.ops.copy(pc.param_slice, pc.master)
        self.params_on_device = self.ops.event()
        self.params_on_device.record(self.copy_stream)
        self.ops.wait_event(self.ops.current_stream(), self.params_on_device)


class ShardedOptimizer:
    """The spec's optimizer over `pieces` (its parameter groups rule reads each piece's
    parameter and its name; `hyper`: its hyperparameters, see optimizer_spec.hyperparameters;
    `tp_group`: for a whole-matrix update that gathers TP shards)."""

    def __init__(
        self,
        pieces: list[Piece],
        spec: OptimizerSpec,
        hyper: dict,
        offload: str,
        tp_group=None,
        nvme: NvmeSettings | None = None,
    ):
        """`offload`: "none", "cpu" (the host copies, `_Transfers`) or "nvme" (the swap of
        nvme.py, under `nvme`'s path and buffer)."""
        self.pieces, self.offload, self.spec = pieces, offload, spec
        self.transfers = None  # offload: the host copies (module docstring)
        if offload == "cpu":
            device = pieces[0].grad.device if pieces else torch.device("cpu")
            cuda = device.type == "cuda" and torch.cuda.is_available() and not fake.active()
            self.transfers = _Transfers(pieces, _CudaOps() if cuda else _HostOps())
        on_cuda = bool(pieces) and pieces[0].master.is_cuda
        fused = any(pc.master.is_cuda for pc in pieces) or fake.active()
        named = [(pc.master, pc.param, pc.buffer.names.get(id(pc.param), "")) for pc in pieces]
        self.inner = make_optimizer(spec, named, hyper, fused, tp_group)
        self.group_of = tensor_groups(self.inner)  # id(master) -> its ParamGroup
        for pc in pieces:  # states exist from the start, so memory is measured before step 1
            step = torch.zeros((), device=pc.master.device if on_cuda else "cpu")
            group = self.group_of[id(pc.master)]
            self.inner.state[pc.master] = {"step": step, **init_states(spec, pc.master, group)}
        self.swap, self._staged = None, None  # NVMe: the swap file; the states a save read
        if offload == "nvme":
            names = [self._state_names(pc) for pc in pieces]
            numels = [pc.hi - pc.lo for pc in pieces]
            self.swap = NvmeStates(nvme.path, nvme.rank, numels, names, nvme.buffer_bytes,
                                   pin=torch.cuda.is_available())  # fmt: skip
            self.sync_masters_from_params()

    def _state_names(self, pc: Piece) -> tuple[str, ...]:
        return tuple(st.name for st in self.spec.group_states(self.group_of[id(pc.master)]))

    @property
    def param_groups(self):
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        if self.swap is not None:
            self._staged = None
            self.swap.step(self._step_swapped)
            return
        offload = self.transfers
        if offload is not None:
            offload.grads_to_host()
        else:
            for pc in self.pieces:
                pc.master.grad = pc.grad
        self.inner.step()
        if offload is not None:
            offload.params_to_device()
        else:
            for pc in self.pieces:
                if not pc.aliased:
                    pc.param_slice.copy_(pc.master, non_blocking=True)
        for pc in self.pieces:
            pc.master.grad = None

    def _step_swapped(self, first: int, last: int, views: list[list[torch.Tensor]]) -> None:
        """NVMe offload: the torch optimizer on pieces [first, last), whose masters and states
        are `views` of the swap buffer (nvme.py) for this call; the others have no .grad,
        so it skips them."""
        group = self.pieces[first:last]
        for pc, (master, *states) in zip(group, views, strict=True):
            pc.master.data = master
            state = self.inner.state[pc.master]
            state.update(zip(self._state_names(pc), states, strict=True))
            pc.master.grad = pc.grad.to("cpu")  # the host's gradient itself on a CPU run
        try:
            self.inner.step()
            for pc in group:
                pc.param_slice.copy_(pc.master)  # blocking: the buffer is reused next
        finally:
            for pc in group:
                pc.master.grad, pc.master.data = None, self.swap.empty
                state = self.inner.state[pc.master]
                state.update((k, self.swap.empty) for k in self._state_names(pc))

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        """After the parameters were loaded (checkpoint): masters that are copies follow."""
        for i, pc in enumerate(self.pieces):
            if self.swap is not None:
                self.swap.write_master(i, pc.param_slice.to("cpu", torch.float32, copy=True))
            elif not pc.aliased:
                pc.master.copy_(pc.param_slice)

    def commit_loaded_states(self) -> None:
        """NVMe offload: the states a checkpoint load filled (`state_shards`' tensors) go
        to the swap file; nothing otherwise (the load filled the optimizer's own tensors)."""
        if self.swap is not None and self._staged is not None:
            self.swap.write_pieces(self._staged)
            self._staged = None

    def close(self) -> None:
        """NVMe offload: remove the swap file (a clean end; it is scratch)."""
        if self.swap is not None:
            self.swap.close()

    # ------------------------------------------------------------ checkpoints
    @property
    def weight_dtype(self) -> torch.dtype:
        """The parameters' dtype (one for all of them, see builder._param_dtype)."""
        return self.pieces[0].param.dtype if self.pieces else torch.float32

    def state_shards(self) -> list[StateShard]:
        """Each piece's states (and master, when it is a copy) over its range of the
        parameter (NVMe offload: read from the swap file into host tensors, which a load fills
        and `commit_loaded_states` stores). Identical copies: ZeRO-0's whole state on every
        rank of the buffer's group;
        with hybrid sharding, the shard on every rank of the replica group; none for a
        parameter this rank owns (whole_matrix.py)."""
        out = []
        if self.swap is not None:  # fresh host tensors read from the swap file
            self._staged = self.swap.read_pieces()
        for i, pc in enumerate(self.pieces):
            state = self.inner.state[pc.master]
            names = self._state_names(pc)
            if self._staged is not None:
                master, *values = self._staged[i]
                states = dict(zip(names, values, strict=True)) | {"master": master}
            else:
                states = {k: state[k].view(-1) for k in names}
            if not pc.aliased and self._staged is None:
                states["master"] = pc.master.data.view(-1)
            buf = pc.buffer
            replicas = buf.group if buf.shard_size == 1 else buf.replica_group
            if pc.owned or (replicas is not None and mappings.size(replicas) == 1):
                replicas = None
            lo, hi = pc.offset(), pc.offset() + pc.hi - pc.lo
            out.append(StateShard(pc.param, lo, hi, states, state["step"], replicas))
        return out
