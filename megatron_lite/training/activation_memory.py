"""Measured activation memory: the bytes of tensors that autograd saves for backward.

`SavedTensorMeter` installs `torch.autograd.graph.saved_tensors_hooks`. Each saved tensor is
wrapped in a small holder that the autograd graph keeps; the holder counts its storage once
(refcounted by storage) and releases it when the graph drops it (after backward, node by node).
So `current_bytes` is what the graph holds now and `peak_bytes` its maximum.

Units are whole storages: views of one storage count once, and a storage counts in full even
when only a view of part of it is saved, because that is what memory really holds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch
from torch import nn

_Key = tuple[str, int]  # (device, storage identity): unique while the storage is alive


def _storage_key(t: torch.Tensor) -> tuple[_Key, int] | None:
    """The storage's key and bytes, or None for a tensor without a readable storage (a
    wrapper subclass such as DTensor: its local tensor is what gets saved and counted)."""
    try:
        s = t.untyped_storage()
        return (str(t.device), s._cdata), s.nbytes()  # _cdata: also a fake tensor's
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (a save then is a
    recomputation's, not the forward's). The one private torch call of this module."""
    return torch._C._current_graph_task_id() != -1


def chunk_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, layer) of every layer of each ModelChunk inside `model` (its `layers`
    ModuleDict, keyed by global layer number), in order: any registered architecture's layer
    class, none assumed."""
    from megatron_lite.models.chunk import ModelChunk

    return [
        (f"{name}.layers.{k}" if name else f"layers.{k}", layer)
        for name, m in model.named_modules()
        if isinstance(m, ModelChunk)
        for k, layer in m.layers.items()
    ]


class _Saved:
    """What the autograd graph keeps for one saved tensor (detached: an alias of its data, so
    a later `out.data = ...` on the original, as pipeline deallocation does, cannot change
    what backward reads); releases its storage on delete."""

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter | None, key: _Key | None):
        self.tensor, self._meter, self._key = tensor.detach(), meter, key

    def __del__(self):
        if self._meter is not None:
            self._meter._release(self._key)


class SavedTensorMeter:
    """Context manager: counts bytes of tensors saved for backward (unique storages), live now
    and peak, while it is entered (forward and backward: a recomputation's saves count too).

    `exclude`: tensors whose storages are not activations (the model parameters; views and
    flat buffers they live in are matched by storage). `nn.Parameter`s and their views are
    always excluded.
    `by_label[name]`: bytes of storages first saved in the forward while `label(name)` was
    active; saves during backward (recomputation) go to `recomputed_bytes` instead. Not seen:
    tensors kept by another saved-tensor hook pair nested inside (torch.utils.checkpoint with
    use_reentrant=False holds its recomputed tensors that way; its saved inputs are counted).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), on_save=None):
        # on_save(key, nbytes, label, new): called for every counted save, in order (`new`:
        # the storage's entry was made by this save; label the active one, or None)
        self.on_save = on_save
        self._excluded = {k[0] for k in map(_storage_key, exclude) if k is not None}
        self._refs: dict[_Key, list[int]] = {}  # key -> [holders alive, bytes]
        self._lock = threading.RLock()  # holders are released on autograd's threads too
        self._labels: list[str] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._handles: list = []
        self.current_bytes = 0
        self.peak_bytes = 0
        self.recomputed_bytes = 0
        self.by_label: dict[str, int] = {}

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Attribute the forward saves made inside the block to `name` (innermost wins)."""
        self._push(name)
        try:
            yield
        finally:
            self._pop()

    def _push(self, name: str) -> None:
        self._labels.append(name)

    def _pop(self) -> None:
        if self._labels:  # attach_labels' hooks may have reset the stack
            self._labels.pop()

    def attach_labels(self, model: nn.Module, module_types: tuple[type, ...] | None = None):
        """Forward hooks labelling the saves of `model`: "layer.<i>" inside each module of
        `module_types` (default: the layers of each ModelChunk in `model`, whatever the
        architecture's layer class; i is the ModuleDict key, the global layer number, else the
        order), "embedding" before the first of them and "output/loss" after the last (final
        norm, output layer, and the loss computed after the model returns). Removed on exit."""
        if module_types is None:
            layers = chunk_layers(model)
        else:
            layers = [(n, m) for n, m in model.named_modules() if isinstance(m, module_types)]
        self._handles.append(model.register_forward_pre_hook(lambda *_: self._top("embedding")))
        for i, (name, m) in enumerate(layers):
            key = name.rsplit(".", 1)[-1]
            tag = f"layer.{key if key.isdigit() else i}"
            self._handles.append(m.register_forward_pre_hook(lambda *_, t=tag: self._push(t)))
            self._handles.append(m.register_forward_hook(lambda *_: self._pop()))
        if layers:
            after = layers[-1][1].register_forward_hook(lambda *_: self._top("output/loss"))
            self._handles.append(after)
        return self

    @property
    def current_label(self) -> str | None:
        """The label forward saves go to now (None: none active)."""
        return self._labels[-1] if self._labels else None

    def held(self, key: _Key) -> bool:
        """Whether a saved tensor of storage `key` is held now."""
        return key in self._refs

    def _top(self, name: str) -> None:
        self._labels[:] = [name]

    def _pack(self, t: torch.Tensor) -> _Saved:
        param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        found = None if param else _storage_key(t)
        if found is None or found[0] in self._excluded:
            return _Saved(t, None, None)
        key, nbytes = found
        with self._lock:
            entry = self._refs.get(key)
            if entry is not None:
                entry[0] += 1
                if self.on_save is not None:
                    self.on_save(key, entry[1], self.current_label, False)
                return _Saved(t, self, key)
            self._refs[key] = [1, nbytes]
            if self.on_save is not None:
                self.on_save(key, nbytes, self.current_label, True)
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            if in_backward():
                self.recomputed_bytes += nbytes
            elif self._labels:
                label = self._labels[-1]
                self.by_label[label] = self.by_label.get(label, 0) + nbytes
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def _release(self, key: _Key) -> None:
        with self._lock:
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._refs[key]
                self.current_bytes -= entry[1]
