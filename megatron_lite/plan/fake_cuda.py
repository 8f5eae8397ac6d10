"""Stand-ins for the CUDA runtime a CPU-only torch lacks, for `plan --dry-run --device cuda`.

Fake tensors can live on `cuda:N` on a CPU-only build (FakeTensorMode gives them the device
and never runs a kernel), but the code around them asks the runtime questions: whether CUDA is
available, the current device, streams and events, pinned host memory, the memory counters,
the CUDA RNG state. `fake_cuda(local_rank)` answers them for the dry run's step, patching
`torch.cuda` (and `Tensor.pin_memory` / `Tensor.record_stream`) inside its block only and
restoring every attribute on exit, so nothing outside the dry run sees a GPU that is not
there. The answers are those of an idle GPU: streams run in order, events are complete, the
memory counters read 0 (the dry run's MemoryTracker measures memory), the RNG state is a
fixed byte tensor. Host waits (`synchronize`, `Event.synchronize`, `Stream.synchronize`) are
reported to `on_sync` (plan/host_sync.py counts them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch

from megatron_lite.parallel.fake import cuda_on_host

# a datasheet-like answer to get_device_properties (kernels/dispatch.py sizes its grids by
# the SM count): an H100 SXM's 132 SMs and 80 GB; the dry run's memory is the tracker's
PROPERTIES = SimpleNamespace(
    name="fake CUDA device (dry run)",
    multi_processor_count=132,
    total_memory=80 * 10**9,
    major=9,
    minor=0,
)

# the CUDA generator's state a dry run reports: a real (not fake) tensor made at import, when
# no fake mode is active (its draws have no values, so its value does not matter)
RNG_STATE = torch.zeros(16, dtype=torch.uint8)


class FakeEvent:
    """torch.cuda.Event: complete as soon as recorded (nothing runs asynchronously here)."""

    def __init__(self, *args, on_sync: Callable[[str], None] = lambda _: None, **kwargs):
        self._on_sync = on_sync

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._on_sync("Event.synchronize")

    def elapsed_time(self, end) -> float:
        return 0.0


class FakeStream:
    """torch.cuda.Stream: a queue that has always finished."""

    def __init__(self, device=None, priority: int = 0, on_sync=lambda _: None, **kwargs):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.priority = priority
        self._on_sync = on_sync

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else FakeEvent(on_sync=self._on_sync)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._on_sync("Stream.synchronize")


@contextlib.contextmanager
def _patched(target, values: dict) -> Iterator[None]:
    """`target`'s attributes set to `values` inside the block, restored (or removed) after."""
    missing = object()
    saved = {k: getattr(target, k, missing) for k in values}
    for k, v in values.items():
        setattr(target, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                delattr(target, k)
            else:
                setattr(target, k, v)


def _pin_memory(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Tensor.pin_memory: a host copy (FakeTensorMode has no pinned allocator; the bytes
    and the device, cpu, are what a pinned copy has)."""
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{t.device}' memory: only host tensors can be pinned")
    return t.clone()


def runtime(local_rank: int, devices: int, on_sync: Callable[[str], None]) -> dict:
    """The torch.cuda attributes fake_cuda installs (see the module docstring)."""
    current = [local_rank]
    default = None  # the default stream, made on first use

    def set_device(d) -> None:
        index = d if isinstance(d, int) else torch.device(d).index
        current[0] = current[0] if index is None else index

    def current_stream(device=None):
        nonlocal default
        default = default or FakeStream(on_sync=on_sync)
        return default

    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: devices,
        "current_device": lambda: current[0],
        "set_device": set_device,
        "get_device_name": lambda device=None: PROPERTIES.name,
        "get_device_capability": lambda device=None: (PROPERTIES.major, PROPERTIES.minor),
        "get_device_properties": lambda device=None: PROPERTIES,
        "synchronize": lambda device=None: on_sync("torch.cuda.synchronize"),
        "Stream": lambda *a, **kw: FakeStream(*a, on_sync=on_sync, **kw),
        "Event": lambda *a, **kw: FakeEvent(*a, on_sync=on_sync, **kw),
        "current_stream": current_stream,
        "default_stream": current_stream,
        "stream": lambda s=None: contextlib.nullcontext(s),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (PROPERTIES.total_memory,) * 2,
        "get_rng_state": lambda device="cuda": RNG_STATE.clone(),
        "set_rng_state": lambda state, device="cuda": None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
    }


def _device_moves() -> dict:
    """`Tensor.to`, `.cpu()` and `.new_tensor` of fake CUDA tensors (see
    parallel/fake.py cuda_on_host: to torch's C++ they are on the host, so its `.to("cpu")`
    would return them unchanged): through the dispatcher, which moves them; the originals
    for every other tensor."""
    to, cpu = torch.Tensor.to, torch.Tensor.cpu
    aten = torch.ops.aten

    def moved(t, device, dtype, non_blocking, copy, memory_format):
        if device == t.device and (dtype is None or dtype == t.dtype) and not copy:
            return t
        # a new tensor and a copy into it (a `_to_copy` or `empty_like` of a host constant
        # would run a real CUDA op in FakeTensorMode's constant propagation)
        if device == t.device:  # a cast on the device
            return aten._to_copy(t, dtype=dtype, memory_format=memory_format)
        out = torch.empty(t.shape, dtype=dtype or t.dtype, device=device)
        return aten.copy_(out, t, non_blocking)

    def to_(t, *args, **kwargs):
        copy = kwargs.pop("copy", False)  # _parse_to takes every argument but this one
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        target = t.device if device is None else device
        if "cuda" not in (t.device.type, target.type):
            return to(t, *args, copy=copy, **kwargs)
        return moved(t, target, dtype, non_blocking, copy, memory_format)

    def cuda_(t, device=None, non_blocking=False, memory_format=torch.preserve_format):
        index = torch.cuda.current_device() if device is None else torch.device(device).index
        return to_(t, torch.device("cuda", index), non_blocking=non_blocking)

    def cpu_(t, memory_format=torch.preserve_format):
        if not t.is_cuda:
            return cpu(t, memory_format=memory_format)
        return moved(t, torch.device("cpu"), None, False, False, memory_format)

    def new_tensor(t, data, dtype=None, device=None, requires_grad=False, **kw):
        out = tensor(data, dtype=dtype or t.dtype, device=device or t.device)
        return out.requires_grad_(requires_grad)

    return {"to": to_, "cpu": cpu_, "cuda": cuda_, "new_tensor": new_tensor}


_tensor = torch.tensor


def tensor(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """torch.tensor: data to a CUDA device is made on the host and copied, as torch does
    (a fake CUDA tensor cannot be made from data directly)."""
    if device is None or torch.device(device).type != "cuda":
        return _tensor(data, dtype=dtype, device=device, requires_grad=requires_grad,
                       pin_memory=pin_memory)  # fmt: skip
    out = _tensor(data, dtype=dtype).to(device)
    return out.requires_grad_(requires_grad) if requires_grad else out


@contextlib.contextmanager
def fake_cuda(
    local_rank: int, devices: int = 8, on_sync: Callable[[str], None] = lambda _: None
) -> Iterator[torch.device]:
    """Inside the block torch answers as a machine with `devices` GPUs whose current one is
    `local_rank` (the module docstring); yields that device. Host waits go to `on_sync` with
    their kind ("torch.cuda.synchronize", "Event.synchronize", "Stream.synchronize")."""
    if not 0 <= local_rank < devices:
        raise ValueError(f"local_rank={local_rank} is not one of the {devices} devices")
    tensor_methods = {
        "pin_memory": _pin_memory,
        "record_stream": lambda t, stream: None,
        **_device_moves(),
    }
    with (
        cuda_on_host(),
        _patched(torch.cuda, runtime(local_rank, devices, on_sync)),
        _patched(torch.Tensor, tensor_methods),
        _patched(torch, {"tensor": tensor}),
    ):
        yield torch.device("cuda", local_rank)
