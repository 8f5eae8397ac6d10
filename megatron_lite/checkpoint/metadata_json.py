"""The shape of a checkpoint's `metadata.json`, checked whenever one is read (files.py).

    {"format": "megatron_lite.dcp/1", "kind": "train" | "model",
     "step": N (>= 0; a train checkpoint's is the N of its step_<N>),
     "consumed_samples": int >= 0 (optional),
     "files": {name: {"bytes": int >= 0, "sha256": hex}
                   | {"bytes": ..., "items": {"<offset>": [length, hex]}}},
     "config": {section: {key: value}}, "layout": {...}, ...}

A file that parses as JSON but breaks any of this was not written by a save (a save writes the
whole file atomically), so it is damage, like a truncated data file: `CheckpointError` names
the file and the rule, resume=auto passes over the checkpoint to an older good one, and a
checkpoint named explicitly stops the run (exit 2). The config's known `model` and `train`
keys must have their config types (load.py and convert_checkpoint.py read them); unknown keys
and sections are left alone (another version may have more).
"""

from __future__ import annotations

import os
import re

from megatron_lite.checkpoint.errors import CheckpointError
from megatron_lite.config import ConfigError, check_section

_HEX = re.compile(r"^[0-9a-f]{64}$")
_STEP_DIR = re.compile(r"^step_(\d+)$")
REQUIRED = ("format", "kind", "step", "files", "config", "layout")
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_JSON_TYPES[type(None)] = "null"


def damaged(file: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{file} is damaged: {why}. A save writes it whole, so this checkpoint cannot be "
        "trusted. Fix: use another checkpoint (train.resume=auto resumes from the newest "
        "valid one)"
    )


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _sha(v) -> bool:
    return isinstance(v, str) and _HEX.match(v) is not None


def _file_row(name, row) -> str | None:
    """What is wrong with one entry of "files", or None."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        return f"files lists {name!r}, which is not a file name in the checkpoint directory"
    where = f"files[{name!r}]"
    if not isinstance(row, dict):
        return f"{where} is {row!r}, not an object"
    if not _count(row.get("bytes")):
        return f"{where}.bytes={row.get('bytes')!r}, which must be an integer >= 0"
    if "items" not in row:
        return None if _sha(row.get("sha256")) else f"{where} has no valid sha256 (64 hex digits)"
    items = row["items"]
    if not isinstance(items, dict):
        return f"{where}.items is {items!r}, not an object"
    for offset, item in items.items():
        ok = isinstance(offset, str) and offset.isdecimal() and isinstance(item, list)
        if not (ok and len(item) == 2 and _count(item[0]) and _sha(item[1])):
            return f"{where}.items[{offset!r}]={item!r}, which must be [length, sha256]"
    return None


def problem(meta, directory: str) -> str | None:
    """What is wrong with `meta` (metadata.json of checkpoint `directory`), or None."""
    if not isinstance(meta, dict):
        return f"it holds a JSON {_JSON_TYPES.get(type(meta), 'value')}, not an object"
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        return f"it has no {', '.join(missing)}"
    if meta["kind"] not in ("train", "model"):
        return f"kind={meta['kind']!r}, which must be 'train' or 'model'"
    step = meta["step"]
    if not _count(step):
        return f"step={step!r}, which must be an integer >= 0"
    named = _STEP_DIR.match(os.path.basename(os.path.normpath(directory)))
    if meta["kind"] == "train" and named and int(named.group(1)) != step:  # a save's step_<N>
        return f"step={step} in the directory {os.path.basename(directory)}"
    if "consumed_samples" in meta and not _count(meta["consumed_samples"]):
        return f"consumed_samples={meta['consumed_samples']!r}, which must be an integer >= 0"
    for key in ("files", "config", "layout"):
        if not isinstance(meta[key], dict):
            return f"{key} is {meta[key]!r:.60}, not an object"
    for name, row in meta["files"].items():
        why = _file_row(name, row)
        if why:
            return why
    for section in ("model", "train"):
        values = meta["config"].get(section, {})
        if not isinstance(values, dict):
            return f"config.{section} is {values!r:.60}, not an object"
        try:
            check_section(section, values)
        except ConfigError as e:
            return f"config.{e}".split(". Fix:")[0]
    return None


def check(file: str, meta, directory: str) -> dict:
    """`meta` if it has the shape above, else CheckpointError naming `file` and the rule."""
    why = problem(meta, directory)
    if why is not None:
        raise damaged(file, why)
    return meta
