"""Activation CPU offload (Megatron-Core's fine-grained activation offloading): the tensors that
chosen submodules of each transformer layer save for backward go to host memory after the
submodule's forward and come back before the layer's backward, prefetched one layer ahead.

How it runs, per layer j of a model chunk (`ActivationOffloader.attach`):
- around each chosen submodule's forward, `torch.autograd.graph.saved_tensors_hooks` collect
  the tensors it saves into one *group*; parameters (saved weights), tensors below
  `min_bytes` and tensor subclasses (DTensor, float8) stay where they are;
- when the submodule returns, the group is *issued*: on CUDA its tensors are copied into
  pinned host memory on a side stream (an event marks the end); at most `inflight` groups are
  in flight, the oldest is waited for when one more is issued, and a completed group drops its
  device tensors (their memory goes back to the allocator once the forward lets them go). On
  CPU the copy is a host copy made when the group completes, so the mechanism (and its byte
  counts and in-flight limit) runs and is tested here;
- in backward, the gradient of layer j's output arriving (a hook on that tensor: layer j's
  backward is next) makes sure layer j's groups are back and starts reloading layer j-1's
  (on the side stream on CUDA), so each copy overlaps one layer's backward; the chunk's last
  layer is reloaded when the pipeline engine announces its backward (`begin_backward`). A
  tensor whose group is not back when autograd asks for it is reloaded then (`late_reloads`).

What is not offloaded:
- a recomputed region's tensors (parallel/recompute.py): inside a checkpoint nothing is saved
  for backward anyway, so the hooks step aside there (`recompute.in_region`), and during the
  backward-time recompute; the layer's `offload_parts` leaves out the parts it recomputes;
- the last layer of a forward whose backward comes next on this rank (`begin_forward(...,
  backward_next=True)`: the pipeline engine reads it from the schedule table): its backward
  starts at once, so a round trip over the host link would only add traffic. The earlier
  layers of that forward are offloaded (they wait for the later layers' forward and backward).

Layers name their parts through `offload_parts() -> {name: module}` (models/transformer.py);
this module imports no model. Names are Megatron-Core's `--offload-modules` where ours match,
`OFFLOAD_MODULES`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.parallel import fake, recompute

# attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm: Megatron-Core's --offload-modules names.
# mlp (a dense layer's whole MLP) and moe_experts (a MoE layer's routed experts) are ours:
# Megatron's expert_fc1 / moe_act split the experts finer than our grouped experts do.
OFFLOAD_MODULES = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "mlp",
    "moe_experts",
)


@dataclass
class OffloadStats:
    """Bytes this rank's offloader moved, since the last `reset` (one step)."""

    offloaded_bytes: int = 0  # copied device -> host
    reloaded_bytes: int = 0  # copied host -> device
    offloaded_tensors: int = 0
    host_bytes: int = 0  # host copies alive now
    peak_host_bytes: int = 0
    in_flight: int = 0  # groups issued, copy not yet complete
    max_in_flight: int = 0
    late_reloads: int = 0  # groups reloaded on demand (the prefetch had not started them)


class _Packed:
    """One offloaded saved tensor: its device tensor until the copy completes, then its host
    copy until reloaded, then the reloaded device tensor (held by the autograd graph only)."""

    __slots__ = ("device", "host", "group", "nbytes")

    def __init__(self, t: torch.Tensor, group: _Group):
        self.device, self.host, self.group = t.detach(), None, group
        self.nbytes = t.numel() * t.element_size()


class _Group:
    """The offloaded saves of one submodule's forward in one layer."""

    def __init__(self, name: str):
        self.name = name
        self.items: list[_Packed] = []
        self.index: dict[tuple, _Packed] = {}  # one copy per distinct view
        self.event = None  # CUDA: the copy's end (D2H, then H2D)
        self.cuda = False  # copied on the side stream (real CUDA tensors)
        self.state = "open"  # open -> issued -> offloaded -> reloaded


class _Layer:
    """The groups of one layer's forward; `prev` is the chunk's previous layer's (same
    forward), reloaded when this layer's backward starts."""

    def __init__(self, prev: _Layer | None):
        self.groups: list[_Group] = []
        self.prev = prev


def _dense(t: torch.Tensor) -> bool:
    """Whether t's strides lay it out densely (some permutation of a contiguous tensor)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _copy_stride(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides when they are dense (the backward then reads the layout it would have
    read), else contiguous ones."""
    return t.stride() if _dense(t) else torch.empty(t.shape, device="meta").stride()


def _empty_as(t: torch.Tensor, device) -> torch.Tensor:
    """An uninitialized copy target of t's shape and dtype on `device` (_copy_stride)."""
    return torch.empty_strided(t.shape, _copy_stride(t), dtype=t.dtype, device=device)


def _host_copy(t: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """The host target of t's offload copy (on the host by design: the CUDA dry run's
    device check allows this function, plan/device_check.py HOST_SITES)."""
    stride = _copy_stride(t)
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device="cpu", pin_memory=pin)


def _view_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class ActivationOffloader:
    """Offloads the saved tensors of the named submodules of each layer (module docstring).

    modules: names from OFFLOAD_MODULES; min_bytes: smaller saved tensors stay; inflight: the
    most groups whose device->host copy may be in flight (>= 1); device: the compute device
    (CUDA: pinned memory and a side stream; else host copies); on_host(tensors): told of each
    completed group's host copies, which are made inside host_scope() (a memory tracker's
    `offloaded_to_host` and `host_allocations`: host bytes, not device ones)."""

    def __init__(
        self,
        modules: Sequence[str],
        *,
        min_bytes: int = 0,
        inflight: int = 4,
        device: torch.device | None = None,
        on_host: Callable[[list[torch.Tensor]], None] | None = None,
        host_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        unknown = [m for m in modules if m not in OFFLOAD_MODULES]
        if unknown:
            raise ValueError(
                f"model.activation_offload={list(modules)}: unknown submodule(s) {unknown}; "
                f"the names are {list(OFFLOAD_MODULES)}. Fix: name only those"
            )
        if inflight < 1:
            raise ValueError(f"model.activation_offload_inflight={inflight} must be >= 1")
        self.modules, self.min_bytes, self.inflight = tuple(modules), min_bytes, inflight
        self.device = device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.on_host, self.host_scope = on_host, host_scope
        self.stats = OffloadStats()
        self._side = None  # CUDA: the copies' stream, made at the first copy
        self._pending: collections.deque[_Group] = collections.deque()
        self._open: list[tuple[_Group, contextlib.AbstractContextManager]] = []
        self._layer: _Layer | None = None  # the layer whose forward runs now
        self._last: dict[int, _Layer | None] = {}  # chunk -> its latest layer (this forward)
        self._tops: dict[tuple, _Layer] = {}  # (key, chunk) -> last layer of that forward
        self._backward_next = False
        self._handles: list = []

    # ------------------------------------------------------------ wiring
    def attach(self, chunks: Sequence[Sequence[nn.Module]]) -> list[str]:
        """Hook the layers of each chunk (chunks[c]: its layers in order, each with
        `offload_parts()`); returns the "layer/part" names hooked (a name no layer has is not
        hooked: e.g. moe_experts on a dense stage)."""
        hooked = []
        for c, layers in enumerate(chunks):
            for j, layer in enumerate(layers):
                last = j == len(layers) - 1
                pre = layer.register_forward_pre_hook(
                    lambda *_, c=c, j=j, last=last: self._layer_start(c, j, last)
                )
                post = layer.register_forward_hook(
                    lambda _m, _i, out, c=c, last=last: self._layer_end(c, out, last),
                    always_call=True,  # an exception must not leave the state behind
                )
                self._handles += [pre, post]
                parts = getattr(layer, "offload_parts", dict)()
                for name in self.modules:
                    if name in parts:
                        self._hook_part(parts[name], name)
                        hooked.append(f"{j}/{name}")
        return hooked

    def _hook_part(self, module: nn.Module, name: str) -> None:
        pre = module.register_forward_pre_hook(lambda *_: self._part_start(name))
        post = module.register_forward_hook(lambda *_: self._part_end(), always_call=True)
        self._handles += [pre, post]

    def detach(self) -> None:
        """Remove every hook."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------ pipeline engine
    @contextlib.contextmanager
    def forward(self, key, backward_next: bool):
        """Around the forward of pipeline step `key` ((microbatch, chunk)); backward_next: the
        rank's next compute is this key's backward (its last layer stays on the device)."""
        self._backward_next = backward_next
        try:
            yield
        finally:
            self.flush()
            for c, top in self._last.items():
                if top is not None:
                    self._tops[(key, c)] = top
            self._last.clear()
            self._backward_next = False

    def begin_backward(self, key) -> None:
        """Before the backward of `key`: start reloading its chunks' last offloaded layers."""
        for k in [k for k in self._tops if k[0] == key]:
            self._reload_layer(self._tops.pop(k))

    def reset(self) -> None:
        """New step: zero the counters (host_bytes carries what is still held)."""
        held = self.stats.host_bytes
        self.stats = OffloadStats(host_bytes=held, peak_host_bytes=held)

    # ------------------------------------------------------------ forward hooks
    def _active(self) -> bool:
        return (
            torch.is_grad_enabled() and not recompute.in_region() and not recompute.is_recomputing()
        )

    def _layer_start(self, chunk: int, j: int, last: bool) -> None:
        self._layer = None
        if not self._active() or (last and self._backward_next):
            return
        prev = self._last.get(chunk) if j > 0 else None
        self._layer = _Layer(prev)

    def _layer_end(self, chunk: int, out, last: bool) -> None:
        layer, self._layer = self._layer, None
        if last and self._active():  # the chunk's forward ends: its copies complete
            self.flush()
        if layer is None or not layer.groups:
            return
        self._last[chunk] = layer
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _g: self._on_layer_grad(layer))

    def _part_start(self, name: str) -> None:
        if self._layer is None or not self._active():
            self._open.append((None, contextlib.nullcontext()))
            return
        group = _Group(name)
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(t, group), self._unpack
        )
        hooks.__enter__()
        self._open.append((group, hooks))

    def _part_end(self) -> None:
        if not self._open:
            return
        group, hooks = self._open.pop()
        hooks.__exit__(None, None, None)
        if group is not None and group.items and self._layer is not None:
            self._layer.groups.append(group)
            self._issue(group)

    def _pack(self, t: torch.Tensor, group: _Group):
        param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        small = t.numel() * t.element_size() < max(self.min_bytes, 1)
        plain = type(t) is torch.Tensor or fake.is_fake(t)  # a dry run's count like a run's
        if param or small or not plain:
            return t.detach()  # stays: a weight, a small tensor, or a subclass
        key = _view_key(t)
        packed = group.index.get(key)
        if packed is None:
            packed = group.index[key] = _Packed(t, group)
            group.items.append(packed)
        return packed

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        group = packed.group
        if group.state == "issued":  # still in flight: the device tensors are still there
            self._complete_or_cancel(group)
        elif group.state == "offloaded":  # the prefetch did not reach it
            self.stats.late_reloads += 1
            self._reload(group)
        if group.cuda and group.event is not None:
            torch.cuda.current_stream(self.device).wait_event(group.event)
            packed.device.record_stream(torch.cuda.current_stream(self.device))
        return packed.device

    # ------------------------------------------------------------ copies
    @property
    def _stream(self):
        if self._side is None:  # (a dry run's fake CUDA tensors are never copied: no stream)
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _issue(self, group: _Group) -> None:
        """Start the group's device->host copy (CUDA: on the side stream); keep at most
        `inflight` groups in flight."""
        group.state = "issued"
        # a CUDA dry run's fake tensors take this path too, on its stand-in streams and events
        # (plan/fake_cuda.py): its host-sync count then sees the event waits a GPU makes
        group.cuda = self.cuda
        if group.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream), self.host_scope():
                for p in group.items:
                    p.host = _host_copy(p.device, pin=True)
                    p.host.copy_(p.device, non_blocking=True)
                group.event = torch.cuda.Event()
                group.event.record(self._stream)
        while len(self._pending) >= self.inflight:  # room for this one
            self._complete(self._pending.popleft())
        self._pending.append(group)
        st = self.stats
        st.in_flight = len(self._pending)
        st.max_in_flight = max(st.max_in_flight, st.in_flight)

    def flush(self) -> None:
        """Complete every copy in flight (the end of a forward)."""
        while self._pending:
            self._complete(self._pending.popleft())
        self.stats.in_flight = 0

    def _complete(self, group: _Group) -> None:
        if group.state != "issued":
            return
        if group.cuda:
            # the compute stream, not the host, waits for the copy (no host sync): the device
            # tensors are freed below, and their next use on that stream comes after it
            torch.cuda.current_stream(self.device).wait_event(group.event)
        else:
            with self.host_scope():
                for p in group.items:
                    p.host = _host_copy(p.device)
                    p.host.copy_(p.device)
        st = self.stats
        for p in group.items:
            p.device = None  # the host copy is what the graph keeps now
            st.offloaded_bytes += p.nbytes
            st.host_bytes += p.nbytes
        st.offloaded_tensors += len(group.items)
        st.peak_host_bytes = max(st.peak_host_bytes, st.host_bytes)
        group.state, group.event = "offloaded", None
        if self.on_host is not None:
            self.on_host([p.host for p in group.items])

    def _complete_or_cancel(self, group: _Group) -> None:
        """A group asked for while still in flight: its device tensors are still there."""
        if group.state == "issued":
            if group in self._pending:
                self._pending.remove(group)
            if group.cuda:
                group.event.synchronize()
            for p in group.items:
                p.host = None
            group.state, group.event, group.index = "reloaded", None, {}

    def _reload(self, group: _Group) -> None:
        """Start the group's host->device copy (CUDA: on the side stream)."""
        if group.state != "offloaded":
            return
        if group.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for p in group.items:
                    p.device = _empty_as(p.host, self.device)
                    p.device.copy_(p.host, non_blocking=True)
                group.event = torch.cuda.Event()
                group.event.record(self._stream)
        else:
            for p in group.items:
                p.device = _empty_as(p.host, self.device)
                p.device.copy_(p.host)
        st = self.stats
        for p in group.items:
            st.reloaded_bytes += p.nbytes
            st.host_bytes -= p.nbytes
            p.host = None
        # the graph's holders own the tensors from here: the group lets go of them
        group.state, group.items, group.index = "reloaded", [], {}

    def _reload_layer(self, layer: _Layer | None) -> None:
        if layer is None:
            return
        for group in layer.groups:
            self._complete_or_cancel(group) if group.state == "issued" else self._reload(group)

    def _on_layer_grad(self, layer: _Layer) -> None:
        """Layer `layer`'s backward is next: its groups must be back, the previous layer's
        start coming back now."""
        self._reload_layer(layer)
        self._reload_layer(layer.prev)
        layer.prev = None
