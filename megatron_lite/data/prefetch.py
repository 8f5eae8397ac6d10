"""Background prefetching: the next steps' microbatches are read while the current step runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

_DONE = object()


class Prefetcher:
    """Runs `fetch_fn(key)` for each key of `keys`, in order, on a background thread, at most
    `depth` results ahead of the consumer.

    Iterate it (or call `get(key)`, which also checks that `key` is the next one) to receive
    `(key, fetch_fn(key))` in key order. An exception in `fetch_fn` is re-raised in the consumer
    at the key where it happened. `pin_memory` (None = when CUDA is available) pins every
    tensor of the result (nested lists/tuples/dicts) on the background thread, so a later
    `.to(device, non_blocking=True)` can overlap. `close()` (or leaving a `with` block) stops
    the thread and drops what was prefetched; it is safe to call twice.

    Example: `with Prefetcher(lambda s: microbatches_for_step(ds, s, ...), range(k, n)) as p:`
    then `for step, micro in p: ...`.
    """

    def __init__(
        self,
        fetch_fn: Callable[[Any], Any],
        keys: Iterable,
        depth: int = 2,
        pin_memory: bool | None = None,
    ):
        if depth < 1:
            raise ValueError(f"prefetch depth={depth} must be >= 1")
        self._fetch, self._keys = fetch_fn, iter(keys)
        self._pin = _cuda_available() if pin_memory is None else pin_memory
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, name="data-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for key in self._keys:
                if self._stop.is_set():
                    return
                value = self._fetch(key)
                if self._pin:
                    value = _pin(value)
                if not self._put((key, value, None)):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put((None, None, e))
            return
        self._put((_DONE, None, None))

    def _put(self, item) -> bool:
        """Block until there is room or close() is called; False when closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[Any, Any]:
        if self._finished:
            raise StopIteration
        key, value, error = self._queue.get()
        if error is not None:
            self._finished = True
            self.close()
            raise error
        if key is _DONE:
            self._finished = True
            raise StopIteration
        return key, value

    def get(self, key) -> Any:
        """The result for `key`, which must be the next key of `keys`."""
        try:
            got, value = next(self)
        except StopIteration:
            raise KeyError(f"prefetcher has no key {key!r}: its keys are exhausted") from None
        if got != key:
            self.close()
            raise KeyError(f"prefetcher expected key {got!r} next, was asked for {key!r}")
        return value

    def close(self) -> None:
        """Stop the background thread and drop prefetched results."""
        self._stop.set()
        while True:  # unblock a put() waiting for room
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _pin(value):
    """`value` with every torch tensor in it pinned (page-locked) for asynchronous copies."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.pin_memory()
    if isinstance(value, list | tuple):
        return type(value)(_pin(v) for v in value)
    if isinstance(value, dict):
        return {k: _pin(v) for k, v in value.items()}
    return value
