"""Checkpoint directories on disk: atomic commit, checksums, the `latest` pointer, pruning and
choosing what to resume from. No process groups here (rank 0 calls these).

    <ckpt_dir>/
      latest                 "step_<N>\\n", replaced atomically (rename) after the commit
      step_<N>/              one committed checkpoint
        metadata.json        format, kind (train | model), step, config, layout, files
        .metadata            DCP's index of logical tensors and the chunks each file holds
        __<rank>_0.distcp    DCP data, one file per writing rank
      .tmp-step_<N>/         a save in progress; never read, removed by the next save of N

A checkpoint exists only once `.tmp-step_<N>` has been renamed to `step_<N>`, and
`metadata.json` (written before the rename) holds the sha256 and size of every other file, so
a crash at any point leaves either the previous checkpoint or the complete new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

from megatron_lite.atomic import write_atomic

METADATA = "metadata.json"
LATEST = "latest"
FORMAT = "megatron_lite.dcp/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and says what to do."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code when loaded (see dcp_metadata.py): never skipped
    over, always reported."""


class CheckpointReadError(RuntimeError):
    """Reading checkpoints failed for another reason than damage (I/O, permissions): resume
    stops here rather than fall back to an older checkpoint or to a fresh start."""


def step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step}")


def tmp_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f".tmp-step_{step}")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def share(names, part: tuple[int, int]) -> list[str]:
    """Rank `part[0]` of `part[1]`'s round-robin share of the sorted `names`: checksumming a
    large checkpoint is split across ranks, so no rank waits on one that hashes everything."""
    rank, world = part
    return sorted(names)[rank::world]


def data_files(path: str) -> list[str]:
    """The files of a checkpoint directory that metadata.json lists (all but itself)."""
    return sorted(
        n for n in os.listdir(path) if n != METADATA and os.path.isfile(os.path.join(path, n))
    )


def file_table(
    path: str, part: tuple[int, int] = (0, 1), names: list[str] | None = None
) -> dict[str, dict]:
    """sha256 and size of `names` (default: data_files(path)), or of this rank's share of
    them when `part` = (rank, world)."""
    table = {}
    for name in share(data_files(path) if names is None else names, part):
        full = os.path.join(path, name)
        table[name] = {"sha256": sha256_file(full), "bytes": os.path.getsize(full)}
    return table


def commit(tmp: str, final: str, meta: dict, table: dict[str, dict] | None = None) -> None:
    """Write metadata.json with the files' checksums (`table`, or computed here), then rename
    tmp -> final."""
    meta = {"format": FORMAT, **meta, "files": file_table(tmp) if table is None else table}
    write_atomic(os.path.join(tmp, METADATA), json.dumps(meta, indent=1, sort_keys=True))
    if os.path.exists(final):  # re-saving a step (resumed from an older checkpoint)
        trash = final + f".old-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


def set_latest(ckpt_dir: str, final: str) -> None:
    write_atomic(os.path.join(ckpt_dir, LATEST), os.path.basename(final) + "\n")


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """Committed checkpoint directories as (step, path), newest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(ckpt_dir, name)):
            found.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(found, reverse=True)


def prune(ckpt_dir: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names)."""
    latest = read_latest(ckpt_dir)
    removed = []
    for _, path in list_checkpoints(ckpt_dir)[keep:]:
        if latest is None or os.path.abspath(path) != os.path.abspath(latest):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def read_latest(ckpt_dir: str) -> str | None:
    """The checkpoint directory `latest` points at, or None."""
    try:
        with open(os.path.join(ckpt_dir, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(ckpt_dir, name) if name else None


def read_metadata(path: str) -> dict:
    file = os.path.join(path, METADATA)
    try:
        with open(file) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{file} does not exist: {path} is not a complete megatron_lite checkpoint. "
            "Fix: point at a step_<N> directory (or a checkpoint folder with a `latest` file)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{file} is damaged ({e}). Fix: resume from another checkpoint"
        ) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def verify(path: str, part: tuple[int, int] = (0, 1)) -> dict:
    """Read metadata.json and check the listed files' sizes and sha256 (this rank's share of
    them when `part` = (rank, world)); returns the metadata or raises CheckpointError naming
    the first damaged, truncated or missing file."""
    meta = read_metadata(path)
    fix = "Fix: resume from an older checkpoint (train.resume=auto picks the newest valid one)"
    for name in share(meta["files"], part):
        want = meta["files"][name]
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint file {file} is missing. {fix}")
        size = os.path.getsize(file)
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} is truncated or damaged: {size} bytes, "
                f"expected {want['bytes']}. {fix}"
            )
        if sha256_file(file) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is damaged: sha256 mismatch. {fix}")
    return meta


def resolve(path: str) -> str:
    """A checkpoint directory, or a checkpoint folder whose `latest` names one."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    latest = read_latest(path)
    if latest is not None:
        return latest
    newest = list_checkpoints(path)
    return newest[0][1] if newest else path


def auto_candidates(ckpt_dir: str) -> list[str]:
    """resume=auto's order of preference: `latest` first, then by step, newest first."""
    candidates = [p for _, p in list_checkpoints(ckpt_dir)]
    latest = read_latest(ckpt_dir)
    if latest is not None and os.path.isdir(latest):
        same = os.path.abspath(latest)
        candidates = [latest] + [p for p in candidates if os.path.abspath(p) != same]
    return candidates


def select_auto(ckpt_dir: str, candidates: list[str] | None = None, check=verify):
    """resume=auto: the first of `candidates` (default: auto_candidates) that `check` accepts,
    and messages about every damaged one skipped on the way -> (path | None, notes)."""
    if candidates is None:
        candidates = auto_candidates(ckpt_dir)
    notes = []
    for path in candidates:
        try:
            check(path)
        except CheckpointError as e:
            notes.append(f"skipping damaged checkpoint {path}: {e}")
            continue
        if notes:
            notes.append(f"falling back to the newest valid checkpoint {path}")
        return path, notes
    if notes:
        notes.append("no valid checkpoint left: starting from scratch")
    return None, notes
