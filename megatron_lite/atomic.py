"""Atomic file writes: readers see the old content or the new, never a torn file. And the OS
error behind a failed write, named by its file."""

from __future__ import annotations

import contextlib
import errno
import os

FULL_BELOW = 1 << 20  # bytes free: a write that failed with less left ran out of space


def write_atomic(path: str, data: str | bytes) -> None:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it into place.
    On failure the temporary is removed and the OSError names `path`."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise OSError(e.errno, e.strerror, path) from None


def write_failure(e: BaseException, path: str) -> OSError | None:
    """The OS error behind `e`, a failed write of file `path`, naming `path`; None when it was
    not the OS's. torch's serializer reports a failed write as "[enforce fail ...] unexpected
    pos" with the OSError (e.g. ENOSPC) only in the chain, and a chain does not survive being
    sent to another rank: so the chain is searched, then a full file system is recognized."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        if isinstance(x, OSError) and x.errno is not None:
            return OSError(x.errno, x.strerror, path)
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < FULL_BELOW:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return None
