"""Atomic file writes: readers see the old content or the new, never a torn file."""

from __future__ import annotations

import os


def write_atomic(path: str, data: str | bytes) -> None:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it into place."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
