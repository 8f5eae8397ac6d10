"""The largest token id a `.bin` really holds, proven cheaply on every open.

The `.idx` records the largest id its builder saw, but nothing ties that number to the `.bin`
beside it: a `.bin` of the right size with other content (copied from elsewhere, corrupted)
passes every size check. So a sidecar `<prefix>.maxid.json` records the id range together with
a fingerprint of the `.bin` it was measured on: its size, its mtime and a digest of 16 sampled
4 KiB blocks. Opening a dataset recomputes the fingerprint (a stat and 64 KiB of reads); when it
matches, the recorded range holds; when it does not, or there is no sidecar (a dataset written
before the sidecar existed), the `.bin` is scanned once, vectorized over the mmap, and the
sidecar is rewritten. A directory we cannot write to just means the scan repeats next time.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

SUFFIX = ".maxid.json"
_FORMAT = 1
_BLOCK, _BLOCKS = 4096, 16
_CHUNK = 1 << 26  # tokens per scan step: bounds the time between page-cache reads


def fingerprint(bin_path: str) -> dict:
    """Size, mtime (ns) and a blake2b digest of up to 16 evenly spaced 4 KiB blocks."""
    st = os.stat(bin_path)
    digest = hashlib.blake2b(digest_size=16)
    with open(bin_path, "rb") as f:
        if st.st_size <= _BLOCK * _BLOCKS:
            digest.update(f.read())
        else:
            step = (st.st_size - _BLOCK) // (_BLOCKS - 1)
            for k in range(_BLOCKS):
                f.seek(k * step)
                digest.update(f.read(_BLOCK))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest.hexdigest()}


def scan(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) token id of a flat token array; (0, -1) when it is empty."""
    if tokens.size == 0:
        return 0, -1
    lo, hi = None, None
    for start in range(0, tokens.size, _CHUNK):
        part = tokens[start : start + _CHUNK]
        a, b = int(part.min()), int(part.max())
        lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    return lo, hi


def write_sidecar(prefix: str, bin_path: str, lo: int, hi: int) -> None:
    """Record the id range measured on `bin_path` for `prefix` (atomically; best effort)."""
    record = {"format": _FORMAT, "min_token_id": lo, "max_token_id": hi, **fingerprint(bin_path)}
    path = prefix + SUFFIX
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:  # a read-only dataset directory: the next open scans again
        if os.path.exists(tmp):
            os.remove(tmp)


def read_sidecar(prefix: str, bin_path: str) -> tuple[int, int] | None:
    """The recorded (min, max) id if the sidecar exists and matches the `.bin` as it is now."""
    try:
        with open(prefix + SUFFIX) as f:
            record = json.load(f)
        if record.get("format") != _FORMAT:
            return None
        now = fingerprint(bin_path)
        if any(record.get(k) != v for k, v in now.items()):
            return None
        return int(record["min_token_id"]), int(record["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # missing, unreadable or garbled: measure again


def token_id_range(prefix: str, bin_path: str, tokens: np.ndarray) -> tuple[int, int]:
    """(min, max) token id of the `.bin`: from a matching sidecar, else scanned and recorded."""
    cached = read_sidecar(prefix, bin_path)
    if cached is not None:
        return cached
    lo, hi = scan(tokens)
    write_sidecar(prefix, bin_path, lo, hi)
    return lo, hi
