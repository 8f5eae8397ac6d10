"""`LiveBytes`: the peak bytes of CPU tensor storage alive at once among the storages created
while it is active, for measuring memory on CPU where torch has no allocator statistics."""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Every op's outputs (a DTensor's local tensor) are looked at; each new CPU storage counts
    from then until it is freed (a weakref on the storage, whose Python object torch keeps
    while the storage lives). `peak`: the most bytes alive at once.

    ignore_existing=True: storages that some tensor object already holds on entry (the model
    states, say) are not counted when an op returns a view of them, so a view of what is
    resident costs nothing; without it, the first op output on any storage counts it."""

    def __init__(self, ignore_existing: bool = False):
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()
        self._existing: set[int] = set()
        self.ignore_existing = ignore_existing

    def __enter__(self):
        if self.ignore_existing:
            with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
                warnings.simplefilter("ignore")
                tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
            for t in tensors:
                self._note_existing(t._local_tensor if isinstance(t, DTensor) else t)
        return super().__enter__()

    def _note_existing(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_sparse:
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in self._existing:
            self._existing.add(key)
            weakref.finalize(storage, self._existing.discard, key)  # its address may be reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, DTensor):
                t = t._local_tensor  # what the wrapper's op allocated on this rank
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                try:
                    storage = t.untyped_storage()
                    storage.data_ptr()
                except RuntimeError:  # a wrapper without storage (functional collectives')
                    continue
                self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._alive or key in self._existing:
            return
        self._alive.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.live -= size
