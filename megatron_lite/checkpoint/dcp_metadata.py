"""DCP's `.metadata`, read without executing code from the file.

`.metadata` is a pickle, and torch.distributed.checkpoint unpickles it with `pickle.load`: a
crafted file runs code the moment it is read, and its checksum proves nothing (the checksums
sit in the same directory). `SafeFileSystemReader` is DCP's FileSystemReader with the metadata
read by an allow-list unpickler instead: only DCP's metadata dataclasses and enums, the torch
values they hold (torch.Size, dtypes, layouts, memory formats), paths and plain containers.
Anything else is refused with UnsafeCheckpointError naming the file, before any of it runs.
The result must also be what megatron_lite writes: tensors only, each stored in a file of the
checkpoint directory itself. Tensor data is read by DCP with `torch.load(weights_only=True)`.
`listing_with_dcp_files` checks, after a save, that every file the index names is visible.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import pathlib
import pickle
from collections import OrderedDict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron_lite.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from megatron_lite.checkpoint.files import data_files

DCP_METADATA = ".metadata"
# modules whose dataclasses and enums (defined there) make up DCP's metadata
_DCP_TYPE_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch", "Size"): torch.Size,
    # private helpers torch's own pickles name: a layout by name, a storage entry
    ("torch.serialization", "_get_layout"): None,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("pathlib", "Path"): pathlib.Path,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    """The pickle asks for something outside the allow-list."""


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals; everything else raises before it can be called."""

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _ALLOWED:
            value = _ALLOWED[key]
            return value if value is not None else getattr(importlib.import_module(module), name)
        if module == "torch":  # torch.float32, torch.strided, torch.contiguous_format, ...
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUES):
                return value
        if module in _DCP_TYPE_MODULES:
            value = getattr(importlib.import_module(module), name, None)
            if (
                isinstance(value, type)
                and value.__module__ == module
                and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
            ):
                return value
        raise _Refused(f"it names {module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent reference")


def _refuse(file: str, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refused to load {file}: {why}, which a torch.distributed.checkpoint index never "
        "holds (only DCP metadata types, torch sizes and dtypes, and plain containers are "
        "accepted). The file may have been crafted to run code; nothing in it was executed. "
        "Fix: use a checkpoint written by megatron_lite (or convert one with "
        "tools/convert_checkpoint.py), and do not load checkpoints from untrusted sources"
    )


def read_dcp_metadata(path: str) -> Metadata:
    """DCP's index of checkpoint directory `path`, unpickled through the allow-list and checked
    to describe tensors in files of `path` only."""
    file = os.path.join(path, DCP_METADATA)
    try:
        with open(file, "rb") as f:
            meta = _AllowListUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(
            f"{file} does not exist: {path} is not a complete DCP checkpoint. Fix: resume "
            "from another checkpoint"
        ) from None
    except _Refused as e:
        raise _refuse(file, str(e)) from None
    except OSError:
        raise
    except Exception as e:  # not a pickle, truncated, or a DCP type given the wrong state
        raise CheckpointError(
            f"{file} is damaged ({type(e).__name__}: {e}). Fix: resume from another checkpoint"
        ) from None
    _check_contents(file, meta)
    return meta


def _check_contents(file: str, meta) -> None:
    if not isinstance(meta, Metadata):
        raise _refuse(file, f"it holds a {type(meta).__name__}, not a DCP Metadata")
    for key, entry in (meta.state_dict_metadata or {}).items():
        if not isinstance(entry, TensorStorageMetadata):  # bytes entries are torch.load-ed
            raise _refuse(file, f"entry {key!r} is a {type(entry).__name__}, not a tensor")
    for info in (meta.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".."):
            raise _refuse(file, f"it points at data file {name!r} outside the checkpoint")


class SafeFileSystemReader(dcp.FileSystemReader):
    """dcp.FileSystemReader whose read_metadata never runs pickled code (see module doc), and
    whose read_data holds one stored item at a time: torch's reads a file's items in one loop
    that keeps the last item it read while it loads the next, so it is called per item."""

    def __init__(self, path: str):
        super().__init__(path)
        self._dir = str(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            meta = read_dcp_metadata(self._dir)
            if hasattr(meta, "storage_meta"):  # what torch's own read_metadata adds
                if meta.storage_meta is None:
                    from torch.distributed.checkpoint.metadata import StorageMeta

                    meta.storage_meta = StorageMeta()
                meta.storage_meta.load_id = getattr(self, "load_id", None)
            self._metadata = meta
        return self._metadata

    def read_data(self, plan, planner):
        for item in plan.items:  # one call per item: each is freed before the next is read
            super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
        done = torch.futures.Future()
        done.set_result(None)
        return done


def listing_with_dcp_files(tmp: str) -> tuple[list[str], dict[str, list[tuple[int, int]]]]:
    """The files of a written checkpoint `tmp` (to checksum) and the items DCP stored in each
    (`storage_ranges`), after checking that every file DCP's index names is visible here."""
    names, ranges = data_files(tmp), storage_ranges(tmp)
    wanted = {DCP_METADATA} | set(ranges)
    missing = sorted(wanted - set(names))
    if missing:
        raise CheckpointError(
            f"{tmp}: DCP wrote {missing} but rank 0 cannot see them. Fix: checkpoints need a "
            "file system that every rank shares (train.ckpt_dir)"
        )
    return names, ranges


def storage_ranges(path: str) -> dict[str, list[tuple[int, int]]]:
    """{data file: [(offset, length)]} of every item DCP's index of `path` stores."""
    out: dict[str, list[tuple[int, int]]] = {}
    for info in (SafeFileSystemReader(path).read_metadata().storage_data or {}).values():
        out.setdefault(info.relative_path, []).append((int(info.offset), int(info.length)))
    return out


def planned_reads(metadata: Metadata, plan) -> dict[str, list[tuple[int, int]]]:
    """{data file: [(offset, length)]} of the stored items a DCP LoadPlan reads."""
    out: dict[str, list[tuple[int, int]]] = {DCP_METADATA: []}  # read whole by every rank
    for item in plan.items:
        info = metadata.storage_data[item.storage_index]
        out.setdefault(info.relative_path, []).append((int(info.offset), int(info.length)))
    return out
