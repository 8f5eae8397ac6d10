"""Index arrays built once per machine, cached on disk as `.npy` and memory-mapped by every rank.

A cache entry is a set of named arrays under a key: the blake2b hash of everything they depend
on (the `fields`: data files' sizes and mtimes, seed, seq length, weights, format version).
Layout of a cache directory (by default `index_cache/` next to the data):

    <kind>-<key>-<name>.npy     one array, written with np.save, opened with np.load(mmap_mode="r")
    <kind>-<key>-<name>.json    its record: key, fields, dtype, shape, byte size, digest
    <kind>-<key>.lock           fcntl lock held by the one process that builds the entry

Every file is written to a temporary name, fsynced and renamed into place, the record last, so a
crash never leaves an array that is trusted. An array is trusted only if its record matches the
key and fields, its size, and a blake2b digest of the `.npy` (the whole file up to 1 MiB; above
that its header and 64 evenly spaced 4 KiB blocks, so opening costs the same for any corpus
size; the size check catches truncation). Anything else (no record, another key, truncated,
corrupted, unreadable) is rebuilt, never trusted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
from collections.abc import Callable, Iterator

import numpy as np

from megatron_lite.atomic import write_atomic
from megatron_lite.data.errors import DataFileError

FORMAT = 1
_FULL_DIGEST_BYTES = 1 << 20
_BLOCK, _BLOCKS = 4096, 64


@contextlib.contextmanager
def exclusive(lock_path: str, what: str) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `lock_path`; say once that we wait if another holds it."""
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[data] waiting for another process {what}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def file_stamp(path: str) -> dict:
    """What a cache key needs of a data file: its size and mtime (ns)."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_digest(path: str) -> str:
    """blake2b of the whole file up to 1 MiB, else of its first 4 KiB and 64 sampled blocks."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= _FULL_DIGEST_BYTES:
            digest.update(f.read())
        else:
            step = (size - _BLOCK) // (_BLOCKS - 1)
            for k in range(_BLOCKS):
                digest.update(os.pread(f.fileno(), _BLOCK, k * step))
    return digest.hexdigest()


class IndexCache:
    """The cached arrays of one (kind, fields) entry in `directory`.

    `get_or_build(names, build)` returns {name: read-only memory-mapped array}: from the cache
    when every array is trusted, else `build()` (which returns {name: array}) runs under the
    entry's lock in one process while the others wait, and its arrays are saved and mapped.
    `built` records whether this process ran `build` (for logs and tests).
    """

    def __init__(self, directory: str, kind: str, fields: dict):
        self.directory, self.kind = directory, kind
        self.fields = {"format": FORMAT, "kind": kind, **fields}
        blob = json.dumps(self.fields, sort_keys=True, default=str).encode()
        self.key = hashlib.blake2b(blob, digest_size=8).hexdigest()
        self.built = False

    def path(self, name: str, suffix: str = ".npy") -> str:
        return os.path.join(self.directory, f"{self.kind}-{self.key}-{name}{suffix}")

    def load(self, name: str) -> np.ndarray | None:
        """The trusted memory-mapped array `name`, or None when it is missing or not trusted."""
        path = self.path(name)
        try:
            with open(self.path(name, ".json")) as f:
                record = json.load(f)
            if (
                record.get("key") != self.key
                or record.get("fields") != json.loads(json.dumps(self.fields, default=str))
                or record.get("size") != os.path.getsize(path)
                or record.get("digest") != file_digest(path)
            ):
                return None
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            if hasattr(mmap, "MADV_RANDOM") and isinstance(getattr(arr, "_mmap", None), mmap.mmap):
                arr._mmap.madvise(mmap.MADV_RANDOM)  # lookups touch a page, not a readahead
            if str(arr.dtype) != record.get("dtype") or list(arr.shape) != record.get("shape"):
                return None
            return arr
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # missing, unreadable or garbled: rebuild

    def save(self, name: str, arr: np.ndarray) -> None:
        """Write `arr` atomically (array first, then its record)."""
        path = self.path(name)
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        record = {
            "key": self.key,
            "fields": self.fields,
            "name": name,
            "dtype": str(arr.dtype),
            "shape": list(arr.shape),
            "size": os.path.getsize(path),
            "digest": file_digest(path),
        }
        write_atomic(self.path(name, ".json"), json.dumps(record, indent=1, default=str))

    def get_or_build(
        self, names: tuple[str, ...], build: Callable[[], dict[str, np.ndarray]]
    ) -> dict[str, np.ndarray]:
        """{name: mmap} of the entry, building (once per machine, under the lock) if needed."""
        found = self._load_all(names)
        if found is not None:
            return found
        self._make_directory()
        what = f"building data indices {self.kind}-{self.key} in {self.directory}"
        lock = os.path.join(self.directory, f"{self.kind}-{self.key}.lock")
        with exclusive(lock, what):
            found = self._load_all(names)  # another process may have built it meanwhile
            if found is not None:
                return found
            arrays = build()
            for name in names:
                self.save(name, arrays[name])
            del arrays
            self.built = True
            found = self._load_all(names)
        if found is None:
            raise DataFileError(
                f"{self.directory}: the index cache written just now does not read back "
                f"({self.kind}-{self.key}). Fix: check the disk, or set data.index_cache_dir "
                f"to another directory"
            )
        return found

    def _load_all(self, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
        out = {}
        for name in names:
            arr = self.load(name)
            if arr is None:
                return None
            out[name] = arr
        return out

    def _make_directory(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            writable = os.access(self.directory, os.W_OK)
        except OSError:
            writable = False
        if not writable:
            raise DataFileError(
                f"{self.directory}: cannot write the data index cache there. Fix: set "
                f"data.index_cache_dir to a writable directory (every rank of a machine must "
                f"see the same one)"
            )
