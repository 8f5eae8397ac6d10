"""The swap file of NVMe optimizer offload (nvme.py): one directory per run and rank under the
user's path, asynchronous reads and writes on a thread pool (`os.preadv` / `os.pwritev`, which
release the GIL), and errors that name the path.

A swap directory is named `megatron_lite_swap.<host>.<pid>.<start>.rank<R>` (`start`: the
process's start time in clock ticks, /proc/<pid>/stat, so a reused pid is not mistaken for the
owner). At start every directory of that pattern whose owner on this host is gone (a crash, a
kill -9) is removed; directories of live processes (another run sharing the path) are kept. A
clean exit removes the run's own directory (`SwapFile.close`, also at interpreter exit).

The file is allocated in full at start (`posix_fallocate`), so a filesystem too small fails
there, before step 1, and reads of never-written ranges return zeros (the optimizer's initial
moments). A write that still fails later (a full disk, RLIMIT_FSIZE, a vanished device) raises
`NvmeSwapError` from the step, before anything writes a checkpoint, so the last one is intact.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

PREFIX = "megatron_lite_swap"
IO_CHUNK = 8 << 20  # bytes per read/write call: the pool runs several at once
IO_THREADS = 4
_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class NvmeSwapError(RuntimeError):
    """The swap file under train.nvme_path could not be created, read or written."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (the run lock's reader of /proc/<pid>/stat),
    as the directory name spells it; None if gone."""
    from megatron_lite.checkpoint.lock_file import process_start_ticks

    ticks = process_start_ticks(pid)
    return None if ticks is None else str(ticks)


def swap_dir_name(rank: int, pid: int | None = None) -> str:
    """This process's swap directory name for `rank` (module docstring)."""
    pid = os.getpid() if pid is None else pid
    return f"{PREFIX}.{socket.gethostname()}.{pid}.{_start_time(pid) or 0}.rank{rank}"


def discard_stale(root: str) -> list[str]:
    """Remove the swap directories under `root` whose owner process on this host is gone (or
    is another process under a reused pid); returns their paths. Other hosts' are kept."""
    removed, host = [], socket.gethostname()
    for name in sorted(os.listdir(root)):
        parts = name.split(".")
        if len(parts) < 5 or parts[0] != PREFIX or not parts[-1].startswith("rank"):
            continue
        pid_text, start = parts[-3], parts[-2]
        if ".".join(parts[1:-3]) != host or not pid_text.isdigit():
            continue
        if _start_time(int(pid_text)) != start:  # gone, or its pid now another process's
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _fix(err: OSError, nbytes: int) -> str:
    if err.errno in _SPACE:
        return (
            f"free space on that filesystem (the swap needs {nbytes} bytes), or set "
            "train.nvme_path to one with room (or raise the file-size limit, ulimit -f)"
        )
    return "check that the path still exists and its device is mounted and healthy"


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")  # a contiguous CPU tensor's bytes, no copy


class SwapFile:
    """One rank's swap file of `nbytes` under `root` (module docstring), with a pool of
    IO_THREADS threads. `read(t, offset)` / `write(t, offset)` fill / store a contiguous fp32
    CPU tensor at a byte offset and return futures (one per IO_CHUNK); `wait` raises the first
    failure as an `NvmeSwapError`."""

    def __init__(self, root: str, rank: int, nbytes: int):
        self.root, self.nbytes = root, nbytes
        try:
            discard_stale(root)
            self.dir = os.path.join(root, swap_dir_name(rank))
            os.makedirs(self.dir)
            self.path = os.path.join(self.dir, "states.bin")
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise self._error("creating the swap directory under", root, 0, e) from e
        self._finalizer = weakref.finalize(self, _remove, self.fd, self.dir)
        if threading.current_thread() is threading.main_thread():
            # past RLIMIT_FSIZE a write fails with EFBIG (reported below) instead of the signal
            # killing the process before it can say why
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            self.close()
            raise self._error("allocating", self.path, nbytes, e) from e
        self.pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="nvme-swap")

    def _error(self, what: str, path: str, nbytes: int, e: OSError) -> NvmeSwapError:
        return NvmeSwapError(
            f"train.nvme_path={self.root!r}: {what} {path} ({nbytes} bytes) failed: "
            f"[Errno {e.errno}] {e.strerror}. Fix: {_fix(e, self.nbytes)}."
        )

    def check(self) -> None:
        """The file is still linked (a removed directory or file is an error, not a silent
        write into an unlinked inode)."""
        if os.fstat(self.fd).st_nlink == 0 or not os.path.exists(self.path):
            raise NvmeSwapError(
                f"train.nvme_path={self.root!r}: the swap file {self.path} vanished (removed, "
                "or its filesystem unmounted) while training. Fix: keep the path mounted and "
                "untouched during the run; resume from the last checkpoint (train.resume=auto)."
            )

    def _io(self, write: bool, t: torch.Tensor, offset: int) -> None:
        view, done = _as_bytes(t), 0
        call = os.pwritev if write else os.preadv
        while done < len(view):
            try:
                n = call(self.fd, [view[done:]], offset + done)
            except OSError as e:
                what = "writing" if write else "reading"
                raise self._error(what, self.path, len(view) - done, e) from e
            if n == 0:  # a read past the end: the file was truncated under us
                raise self._error(
                    "reading", self.path, len(view) - done, OSError(errno.EIO, "short read")
                )
            done += n

    def submit(self, write: bool, t: torch.Tensor, offset: int) -> list[Future]:
        """Futures of `t`'s bytes read from / written to the file at byte `offset`."""
        flat, step = t.view(-1), IO_CHUNK // t.element_size()
        return [
            self.pool.submit(self._io, write, flat[i : i + step], offset + i * t.element_size())
            for i in range(0, flat.numel(), step)
        ]

    def read_now(self, t: torch.Tensor, offset: int) -> None:
        wait(self.submit(False, t, offset))

    def write_now(self, t: torch.Tensor, offset: int) -> None:
        wait(self.submit(True, t, offset))

    def close(self) -> None:
        """Stop the pool, close and remove the swap directory (idempotent)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        self._finalizer()


def wait(futures: list[Future]) -> None:
    """Wait for every future; the first failure is raised (after all have finished, so no
    thread still writes into a buffer the caller reuses)."""
    error = None
    for f in futures:
        e = f.exception()
        error = error or e
    if error is not None:
        raise error


def _remove(fd: int, path: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)
