"""`LiveBytes`: the peak bytes of CPU tensor storage alive at once among the storages created
while it is active, for measuring memory on CPU where torch has no allocator statistics."""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Every op's outputs (a DTensor's local tensor) are looked at; each new CPU storage counts
    from then until it is freed (a weakref on the storage, whose Python object torch keeps
    while the storage lives). `peak`: the most bytes alive at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, DTensor):
                t = t._local_tensor  # what the wrapper's op allocated on this rank
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._alive:
            return
        self._alive.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.live -= size
