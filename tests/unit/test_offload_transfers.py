"""Optimizer offload's host copies (parallel/data_parallel/optimizer.py `_Transfers`) are ordered
by events: each copy runs on the copy stream after an event of the compute stream, an event is
recorded after the copies, and it is waited for (by the host, or by the compute stream) before
the copies' results are used; no stream is ever synchronized whole. CUDA's events are replaced
by a stand-in that records the order, so the ordering is checked on CPU."""

import contextlib
from types import SimpleNamespace

import torch

from megatron_lite.parallel.data_parallel.optimizer import _HostOps, _Transfers


class _Event:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream))

    def synchronize(self) -> None:
        self.log.append(("host waits", self.name))


class _Stream(str):
    def synchronize(self):  # what the design must never need
        raise AssertionError(f"stream {self} synchronized whole")


class _RecordingOps(_HostOps):
    """Named streams and events; copies really happen (CPU tensors) and are logged with the
    stream they were issued on."""

    def __init__(self):
        self.log, self.events, self.active = [], 0, _Stream("compute")

    def event(self):
        self.events += 1
        return _Event(self.log, f"e{self.events}")

    def current_stream(self):
        return _Stream("compute")

    def new_stream(self):
        return _Stream("copy")

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.active = self.active, stream
        yield
        self.active = before

    def wait_event(self, stream, event) -> None:
        self.log.append(("wait", stream, event.name))

    def to_host(self, t):
        self.log.append(("to host", self.active))
        return t.clone()

    def copy(self, dst, src) -> None:
        self.log.append(("to device", self.active))
        dst.copy_(src)


def _pieces(n: int = 2):
    return [
        SimpleNamespace(
            grad=torch.full((3,), float(i + 1)),
            master=torch.nn.Parameter(torch.zeros(3)),
            param_slice=torch.zeros(3),
            aliased=False,
        )
        for i in range(n)
    ]


def _one_step(transfers, ops, pieces, step: int):
    transfers.grads_to_host()
    ops.log.append(("adamw",))
    grads = [pc.master.grad.clone() for pc in pieces]
    with torch.no_grad():
        for pc in pieces:
            pc.master.add_(10 * step)
    transfers.params_to_device()
    return grads


def _step_log(first: int, host_waits: list[str]):
    e = [f"e{first + i}" for i in range(4)]  # compute ready, grads, compute ready, params
    return [
        ("record", e[0], "compute"),
        ("wait", "copy", e[0]),
        ("to host", "copy"),
        ("to host", "copy"),
        ("record", e[1], "copy"),
        *[("host waits", w) for w in [*host_waits, e[1]]],
        ("adamw",),
        ("record", e[2], "compute"),
        ("wait", "copy", e[2]),
        ("to device", "copy"),
        ("to device", "copy"),
        ("record", e[3], "copy"),
        ("wait", "compute", e[3]),
    ]


def test_offload_copies_are_ordered_by_events_recorded_after_them():
    ops, pieces = _RecordingOps(), _pieces()
    transfers = _Transfers(pieces, ops)
    grads1 = _one_step(transfers, ops, pieces, 1)
    first = list(ops.log)
    ops.log.clear()
    _one_step(transfers, ops, pieces, 2)
    assert first == _step_log(1, []), f"step 1's order: {first}"
    # step 2: before AdamW overwrites the masters, the host also waits for step 1's copies
    # that read them (e4)
    assert ops.log == _step_log(5, ["e4"]), f"step 2's order: {ops.log}"
    for i, pc in enumerate(pieces):
        assert grads1[i].equal(pc.grad), f"piece {i}: the host gradient is not the shard's"
        assert pc.param_slice.equal(pc.master.detach()), f"piece {i}: weights not copied back"


def test_host_offload_uses_the_shard_itself_and_plain_copies():
    """On a CPU run (the host is the device) the gradient is the shard itself, not a copy, and
    the weights are plain copies: the arithmetic is that of the run before events existed."""
    pieces = _pieces()
    transfers = _Transfers(pieces, _HostOps())
    transfers.grads_to_host()
    assert all(pc.master.grad is pc.grad for pc in pieces)
    with torch.no_grad():
        pieces[0].master.fill_(7.0)
    transfers.params_to_device()
    assert pieces[0].param_slice.equal(torch.full((3,), 7.0))
