"""`MemoryTracker`: every allocation and free of tensor storage, in order, with the peak by
category and where in the step it happened. It runs on real tensors (a CPU run, where torch
keeps no allocator statistics) and on a dry run's fake tensors (plan --dry-run) alike, so the
two can be compared figure by figure.

How it sees memory:
- a `TorchDispatchMode` looks at every op's outputs; a storage it has not seen counts from then
  until it is freed (a weakref finalizer on the storage, whose Python object torch keeps while
  the storage lives); a DTensor counts its local tensor;
- `UntypedStorage.resize_` is wrapped while the tracker is active, because the code frees and
  re-allocates storage that way (ZeRO-2 gradient buckets, FSDP2's unsharded parameters);
- what a collective's `Work.wait` allocates is not counted: gloo finishes a reduce-scatter by
  copying out of a staging buffer of the whole input there, memory of the CPU backend that
  NCCL (in place) and a dry run's fake group do not have; and
  tensors created outside the mode's view (factory calls of C++ code) are counted when
  `label` names them.

Categories. `label(tensors, category)` names storages: the model states (weights, grads,
master, optimizer: `label_model_states`) and FSDP2's gathered weights (`gathered`). An unnamed
storage is "activations" when it was allocated in a forward (outside autograd's backward and
outside a working phase: the gradient sync, the optimizer step) and "temporaries" otherwise:
a forward tensor still alive at the peak is held for the backward (saved by autograd, or a
pipeline stage's input or output), everything else is a working buffer. `phase(name)` says
where the step is (the trainer names forward, grad sync and optimizer; transformer-layer hooks
name forward/backward of layer k), and the peak records the phase it happened in.
`category_peaks` holds each category's own maximum (which need not be at the same instant as
the peak of the total).

Host copies of offloaded activations (model.activation_offload) are made inside
`host_allocations()` (not device memory, on a CPU run too) and named by
`offloaded_to_host(tensors)`: they count in `host_bytes` / `host_peak` until freed, on CPU
and CUDA alike.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from megatron_lite.training.activation_memory import in_backward

CATEGORIES = (
    "weights",
    "grads",
    "master",
    "optimizer",
    "buffers",
    "gathered",
    "activations",
    "temporaries",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor):
        return None
    t = _local(t)
    while is_traceable_wrapper_subclass(t):  # its own storage is nominal (numel × its dtype,
        t = getattr(t, t.__tensor_flatten__()[0][0])  # no memory): its first inner tensor's
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@dataclass
class Peak:
    """The most bytes alive at once, by category, and the phase it happened in."""

    total: int = 0
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    phase: str = ""


class MemoryTracker(TorchDispatchMode):
    """See the module docstring. Use as a context manager around the code to measure (the
    model build included, so its states are seen as they are allocated)."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self._live: dict[int, list] = {}  # storage key -> [bytes, category]
        self._labels: dict[int, str] = {}  # storage key -> category named by label()
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = Peak()
        self.peaks_by_phase: dict[str, int] = {}
        self.category_peaks = dict.fromkeys(CATEGORIES, 0)  # each category's own maximum
        self._phases: list[str] = ["build"]
        self._working = 0  # > 0 inside a working phase (see phase)
        self._untracked = 0  # > 0 inside a collective's wait (see __enter__)
        self._categories: list[str] = []  # the category of new storages inside attach_fsdp's
        self._lock = threading.RLock()  # storages are freed on autograd's threads too
        self._resize = None
        self._handles: list = []
        self.host_bytes = 0  # offloaded activations' host copies alive now
        self.host_peak = 0
        self._host: set[int] = set()  # their storage keys

    # ------------------------------------------------------------ context
    def __enter__(self) -> MemoryTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            out = original(storage, size)
            tracker._resized(storage)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        wait = self._wait = dist.Work.wait

        def untracked_wait(work, *a, **kw):
            tracker._untracked += 1
            try:
                return wait(work, *a, **kw)
            finally:
                tracker._untracked -= 1

        dist.Work.wait = untracked_wait
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        dist.Work.wait = self._wait
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    # ------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str, working: bool = False) -> Iterator[None]:
        """The step is in `name` inside the block (innermost wins); working=True marks a part
        outside the forward (gradient sync, optimizer step) whose new storages are
        temporaries (or states labelled later)."""
        self._phases.append(name)
        self._working += working
        try:
            yield
        finally:
            self._phases.pop()
            self._working -= working

    def attach_layers(self, chunks: Iterable[torch.nn.Module]) -> None:
        """Name forward and backward of each layer of the model chunks (any registered
        architecture's layer class) as phases ("forward layer k", "backward layer k"), via
        module hooks (removed on exit)."""
        from megatron_lite.training.activation_memory import chunk_layers

        for chunk in chunks:
            for name, m in chunk_layers(chunk):
                k = name.rsplit(".", 1)[-1]
                fwd = f"forward layer {k}"
                bwd = f"backward layer {k}"
                self._handles.append(
                    m.register_forward_pre_hook(lambda *_, n=fwd, b=bwd: self._enter_layer(n, b))
                )
                self._handles.append(m.register_forward_hook(lambda *_: self._leave_layer()))

    def attach_fsdp(self, modules: Iterable[torch.nn.Module]) -> None:
        """Name FSDP2's allocations (ZeRO-3; call after its lazy init, i.e. after a step):
        what its all-gathers unshard is "gathered", what its post-backward reduce-scatters
        (the flat input and the sharded gradients it leaves) is "grads", and the unsharded
        gradients autograd accumulates across microbatches are "grads" from their first
        accumulation; those a zero-bubble schedule's W writes (outside autograd) from the
        post-backward that follows it. FSDP2's param groups are private: this and
        fsdp_compat.post_backward_now are their readers."""
        for m in modules:
            get_state = getattr(m, "_get_fsdp_state", None)
            group = get_state()._fsdp_param_group if get_state is not None else None
            if group is None:
                continue
            group.unshard = self._as(group.unshard, "gathered")
            group.post_backward = self._as(group.post_backward, "grads", group.fsdp_params)
            for fp in group.fsdp_params:
                # the unsharded weights' storage: created in step 1, resized in and out since
                self.label(getattr(fp, "all_gather_outputs", []), "gathered")
                param = getattr(fp, "_unsharded_param", None)
                if param is not None:
                    hook = param.register_post_accumulate_grad_hook(
                        lambda q: self.label([q.grad], "grads")
                    )
                    self._handles.append(hook)

    def _as(self, fn, category: str, fsdp_params=()):
        """`fn` with its new storages named `category`; first, the unsharded gradients of
        `fsdp_params` (FSDP2's) are named "grads"."""

        def run(*a, **kw):
            grads = (getattr(fp, "_unsharded_param", None) for fp in fsdp_params)
            self.label([q.grad for q in grads if q is not None and q.grad is not None], "grads")
            self._categories.append(category)
            try:
                return fn(*a, **kw)
            finally:
                self._categories.pop()

        return run

    def _enter_layer(self, fwd: str, bwd: str) -> None:
        self._phases.append(bwd.replace("backward", "recompute") if in_backward() else fwd)

    def _leave_layer(self) -> None:
        if len(self._phases) > 1:
            self._phases.pop()

    def where(self) -> str:
        if in_backward() and not self._phases[-1].startswith("recompute"):
            return "backward"
        return self._phases[-1]

    # ------------------------------------------------------------ labels
    def label(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Name the storages of `tensors` `category` (moving bytes already counted; counting
        storages the mode has not seen)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}: one of {CATEGORIES}")
        for t in tensors:
            s = _storage(t)
            if s is None:
                continue
            key = s._cdata
            with self._lock:
                self._labels[key] = category
                entry = self._live.get(key)
                if entry is None:
                    self._track(s)
                elif entry[1] != category:
                    self.current[entry[1]] -= entry[0]
                    self.current[category] += entry[0]
                    entry[1] = category

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Storages made inside the block are not device memory (an activation offloader's
        host copies: `offloaded_to_host` counts them next)."""
        self._untracked += 1
        try:
            yield
        finally:
            self._untracked -= 1

    def offloaded_to_host(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of `tensors` (an activation offloader's host copies) as host
        bytes, out of the device categories (module docstring)."""
        for t in tensors:
            s = _storage(t)
            if s is None:
                continue
            key = s._cdata
            with self._lock:
                if key in self._host:
                    continue
                entry = self._live.pop(key, None)
                if entry is not None:  # a CPU run counted it as a device storage
                    self.current[entry[1]] -= entry[0]
                    self.total -= entry[0]
                self._host.add(key)
                self.host_bytes += s.nbytes()
                self.host_peak = max(self.host_peak, self.host_bytes)
            weakref.finalize(s, self._free_host, key, s.nbytes())

    def _free_host(self, key: int, nbytes: int) -> None:
        with self._lock:
            if key in self._host:
                self._host.discard(key)
                self.host_bytes -= nbytes

    def label_model_states(self, dp) -> None:
        """Name the data-parallel wrapper's model states (its `state_tensors()`), as the
        trainer reports them in mem/*."""
        seen: set[int] = set()  # an fp32 master that is the weight itself stays a weight
        for category, tensors in dp.state_tensors().items():
            mine = [t for t in tensors if (s := _storage(t)) is not None and s._cdata not in seen]
            seen.update(_storage(t)._cdata for t in mine)
            self.label(mine, category)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (e.g. after the first step, once the
        optimizer states exist)."""
        with self._lock:
            self.peak = Peak(self.total, dict(self.current), self.where())
            self.peaks_by_phase = {}
            self.category_peaks = dict(self.current)
            self.host_peak = self.host_bytes

    # ------------------------------------------------------------ counting
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _local(t).device.type == "meta":
                continue  # a meta tensor holds no memory (a fake tensor's device is a real one)
            s = _storage(t)
            if s is not None and s._cdata not in self._live:
                self._track(s)
        return out

    def _default_category(self) -> str:
        if self._categories:
            return self._categories[-1]
        if self._working or in_backward():
            return "temporaries"
        return "activations"

    def _track(self, s: torch.UntypedStorage) -> None:
        if self._untracked or s.device.type not in (self.device_type, "meta"):
            return
        key, size = s._cdata, s.nbytes()
        with self._lock:
            if key in self._live:
                return
            category = self._labels.get(key) or self._default_category()
            self._live[key] = [size, category]
            self._add(category, size)
        weakref.finalize(s, self._free, key)

    def _resized(self, s: torch.UntypedStorage) -> None:
        key = s._cdata
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._track(s)
                return
            delta = s.nbytes() - entry[0]
            entry[0] = s.nbytes()
            self._add(entry[1], delta)

    def _add(self, category: str, delta: int) -> None:
        self.current[category] += delta
        self.total += delta
        if delta > 0:
            if self.current[category] > self.category_peaks[category]:
                self.category_peaks[category] = self.current[category]
            where = self.where()
            if self.total > self.peaks_by_phase.get(where, 0):
                self.peaks_by_phase[where] = self.total
            if self.total > self.peak.total:
                self.peak = Peak(self.total, dict(self.current), where)

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            self._labels.pop(key, None)
            if entry is not None:
                self.current[entry[1]] -= entry[0]
                self.total -= entry[0]
