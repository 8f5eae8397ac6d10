"""The files of in-memory checkpoints (memory.py): one rank's state as one flat file in host
memory that outlives the process (`/dev/shm`), written complete or not at all. No process
groups here.

    /dev/shm/megatron_lite-<run id>/
      rank<R>-step<N>.bin                 rank R's own copy of its state after step N
      replica-rank<R>-step<N>.by<P>.bin   the replica of it held by rank P (its peer)
      .tmp-*                              a write in progress (renamed when complete)

A file is `MAGIC`, the header's length (8 bytes, little endian), the header (JSON: run id,
step, owner rank, world size, settings fingerprint, consumed samples, and per tensor its key,
dtype, shape, byte offset and size), then the tensors' bytes, each at a 64-byte aligned
offset. Nothing in it is pickled: a file another program left there cannot run code when read.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct

import torch

FORMAT = "megatron_lite.memory/1"
MAGIC = b"MLMEMCK1"
ALIGN = 64
_NAME = re.compile(r"^(?:rank(\d+)-step(\d+)|replica-rank(\d+)-step(\d+)\.by(\d+))\.bin$")
DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.int8,
        torch.bool,
    )
}


def run_root(root: str, run_id: str) -> str:
    """This run's directory under `root` (/dev/shm)."""
    return os.path.join(root, f"megatron_lite-{run_id}")


def own_name(rank: int, step: int) -> str:
    return f"rank{rank}-step{step}.bin"


def replica_name(owner: int, step: int, holder: int) -> str:
    return f"replica-rank{owner}-step{step}.by{holder}.bin"


def parse_name(name: str) -> tuple[int, int] | None:
    """(owner rank, step) of a copy's file name (own or replica), None for anything else."""
    m = _NAME.match(name)
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1)), int(m.group(2))
    return int(m.group(3)), int(m.group(4))


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` on the host, as a 1-d uint8 tensor (a view where it can be)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def layout_header(meta: dict, tensors: dict[str, torch.Tensor]) -> tuple[bytes, int]:
    """(the file's first bytes: magic, length, header JSON padded to ALIGN; the file's size)."""
    rows, offset = [], 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        rows.append([key, str(t.dtype), list(t.shape), offset, n])
        offset = _padded(offset + n)
    header = json.dumps({"format": FORMAT, **meta, "tensors": rows}).encode()
    head = _padded(len(MAGIC) + 8 + len(header))
    blob = MAGIC + struct.pack("<Q", len(header)) + header
    return blob + b"\0" * (head - len(blob)), head + offset


def write_copy(path: str, meta: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` (any device, any of DTYPES) with `meta` to `path`: to a temporary name
    beside it, then renamed, so `path` is complete or absent. Returns the file's bytes."""
    head, size = layout_header(meta, tensors)
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for t in tensors.values():
                data = _flat_bytes(t)
                f.write(memoryview(data.numpy()))
                f.write(b"\0" * (_padded(data.numel()) - data.numel()))
            f.truncate(size)  # the last tensor's padding is not needed
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return size


def read_header(path: str) -> tuple[dict, int]:
    """(the header of the copy at `path`, the offset its tensors' bytes start at); ValueError
    when the file is not a complete copy of this format."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 8)
        if len(start) < len(MAGIC) + 8 or start[: len(MAGIC)] != MAGIC:
            raise ValueError("not an in-memory checkpoint file (no magic)")
        (n,) = struct.unpack("<Q", start[len(MAGIC) :])
        if n > 1 << 30:
            raise ValueError(f"header of {n} bytes")
        header = json.loads(f.read(n).decode())
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format')!r}, expected {FORMAT!r}")
    head = _padded(len(MAGIC) + 8 + n)
    rows = header["tensors"]
    end = head + max((off + nb for _, _, _, off, nb in rows), default=0)
    if os.path.getsize(path) < end:
        raise ValueError(f"truncated: {os.path.getsize(path)} bytes, expected {end}")
    return header, head


def open_bytes(path: str) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private (copy-on-write) mapping: no copy."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else bytearray()
    return torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)


def tensors_of(data: torch.Tensor, header: dict, head: int) -> dict[str, torch.Tensor]:
    """{key: tensor} viewing the bytes `data` of a copy whose header is `header`."""
    out = {}
    for key, dtype, shape, offset, n in header["tensors"]:
        if dtype not in DTYPES:
            raise ValueError(f"tensor {key!r} of dtype {dtype}")
        raw = data[head + offset : head + offset + n]
        out[key] = raw.view(DTYPES[dtype]).reshape(shape)
    return out


def header_of_bytes(data: torch.Tensor) -> tuple[dict, int]:
    """read_header for a copy received into memory (`data`: its bytes)."""
    start = bytes(data[: len(MAGIC) + 8].numpy())
    if start[: len(MAGIC)] != MAGIC:
        raise ValueError("not an in-memory checkpoint (no magic)")
    (n,) = struct.unpack("<Q", start[len(MAGIC) :])
    header = json.loads(bytes(data[len(MAGIC) + 8 : len(MAGIC) + 8 + n].numpy()).decode())
    return header, _padded(len(MAGIC) + 8 + n)


def listing(directory: str) -> list[tuple[int, int, str]]:
    """(owner rank, step, file name) of every complete copy in `directory` (temporaries and
    other files are not copies)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        parsed = parse_name(name)
        if parsed is not None:
            out.append((*parsed, name))
    return sorted(out)
