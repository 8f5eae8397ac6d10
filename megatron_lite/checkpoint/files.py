"""Checkpoint directories on disk: atomic commit, checksums, the `latest` pointer, pruning and
choosing what to resume from. No process groups here (rank 0 calls these).

    <ckpt_dir>/
      latest                 "step_<N>\\n", replaced atomically (rename) after the commit
      step_<N>/              one committed checkpoint
        metadata.json        format, kind (train | model), step, config, layout, files
        .metadata            DCP's index of logical tensors and the chunks each file holds
        __<rank>_0.distcp    DCP data, one file per writing rank
      .tmp-step_<N>/         a save in progress; never read, removed at the next start
      step_<N>.replaced-<T>/ an earlier step_<N> that a new save of step N replaced (kept)

A checkpoint exists only once `.tmp-step_<N>` has been renamed to `step_<N>`, and
`metadata.json` (written before the rename) holds the sha256 and size of every other file, so
a crash at any point leaves either the previous checkpoint or the complete new one. Nothing
here deletes a checkpoint it could not validate: pruning removes only intact checkpoints older
than the newest save, and a replaced step is renamed, not removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

from megatron_lite.atomic import write_atomic
from megatron_lite.checkpoint import metadata_json
from megatron_lite.checkpoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    UnsafeCheckpointError,
)

METADATA = "metadata.json"
LATEST = "latest"
FORMAT = "megatron_lite.dcp/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # written by rank \1 (single_file_per_rank)


def share(names, part: tuple[int, int]) -> list[str]:
    """The files rank `part[0]` of `part[1]` checksums: the DCP data file it wrote itself
    (`__<rank>_0.distcp`, taken modulo the world when it differs), and a round-robin share of
    the rest, so no rank hashes another rank's writes and none waits on one hashing it all."""
    rank, world = part
    mine, rest = [], []
    for name in sorted(names):
        m = _DCP_FILE.fullmatch(name)
        if m:
            if int(m.group(1)) % world == rank:
                mine.append(name)
        else:
            rest.append(name)
    return mine + rest[rank::world]


def data_files(path: str) -> list[str]:
    """The files of a checkpoint directory that metadata.json lists (all but itself)."""
    return sorted(
        n for n in os.listdir(path) if n != METADATA and os.path.isfile(os.path.join(path, n))
    )


def range_hashes(file: str, ranges) -> dict[str, list]:
    """{str(offset): [length, sha256]} of the byte ranges (offset, length) of `file`: DCP's
    stored items, so a rank that reads some of them can check exactly those."""
    out = {}
    with open(file, "rb") as f:
        for offset, length in sorted(set(ranges)):
            f.seek(offset)
            h, left = hashlib.sha256(), length
            while left > 0:
                block = f.read(min(left, 1 << 20))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            out[str(offset)] = [length, h.hexdigest()]
    return out


def file_table(
    path: str,
    part: tuple[int, int] = (0, 1),
    names: list[str] | None = None,
    ranges: dict[str, list[tuple[int, int]]] | None = None,
) -> dict[str, dict]:
    """Size and sha256 of `names` (default: data_files(path)), or of this rank's share of
    them when `part` = (rank, world). A file with `ranges` (DCP's items in it) gets one sha256
    per item (`items`) instead of one for the whole file."""
    table = {}
    for name in share(data_files(path) if names is None else names, part):
        full = os.path.join(path, name)
        row: dict = {"bytes": os.path.getsize(full)}
        if ranges and name in ranges:
            row["items"] = range_hashes(full, ranges[name])
        else:
            row["sha256"] = sha256_file(full)
        table[name] = row
    return table


HASH_PREFIX = ".sha256.rank"  # an async save's per-writer checksums, merged at the commit


def write_own_checksums(tmp: str, rank: int, world: int, ranges=None) -> None:
    """Async save, each rank: the checksums of its share (the file it wrote) in `tmp`, per
    DCP item where `ranges` lists them (see file_table)."""
    names = [n for n in data_files(tmp) if not n.startswith(HASH_PREFIX)]
    table = file_table(tmp, (rank, world), names, ranges)
    write_atomic(os.path.join(tmp, f"{HASH_PREFIX}{rank}.json"), json.dumps(table))


def gather_checksums(tmp: str, world: int, timeout_s: float) -> dict[str, dict]:
    """Rank 0's commit thread: every rank's checksums, once they are all there (polled, so
    no rank waits in a collective for another's hashing); the per-rank files are removed."""
    deadline = time.monotonic() + timeout_s
    paths = [os.path.join(tmp, f"{HASH_PREFIX}{r}.json") for r in range(world)]
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            missing = [p for p in paths if not os.path.exists(p)]
            raise OSError(f"no checksums from {missing} within train.async_save_timeout_s")
        time.sleep(0.1)
    table = {}
    for p in paths:
        with open(p) as f:
            table.update(json.load(f))
        os.remove(p)
    return table


def commit(tmp: str, final: str, meta: dict, table: dict[str, dict] | None = None) -> None:
    """Write metadata.json with the files' checksums (`table`, or computed here), then rename
    tmp -> final."""
    meta = {"format": FORMAT, **meta, "files": file_table(tmp) if table is None else table}
    write_atomic(os.path.join(tmp, METADATA), json.dumps(meta, indent=1, sort_keys=True))
    if os.path.exists(final):  # re-saving a step whose checkpoint was damaged: keep it
        os.replace(final, f"{final}.replaced-{timestamp()}")
    os.replace(tmp, final)


def save_failed(ckpt_dir: str, tmp: str, final: str, why: list[str]) -> CheckpointWriteError:
    """The user-facing error of a failed save of `final` (staged in `tmp`), saying what is left
    on disk; `why` are the failing ranks' errors."""
    step = int(os.path.basename(final).removeprefix("step_"))
    fix = (
        f"Fix: make train.ckpt_dir={ckpt_dir} writable with enough free space, then resume "
        "with train.resume=auto"
    )
    if os.path.isdir(final):  # failed after the rename: `latest` or pruning
        return CheckpointWriteError(
            f"could not finish saving checkpoint {final} (step {step}) after its commit: "
            f"{'; '.join(why)}. The checkpoint itself is complete. {fix}"
        )
    older = [p for s, p in list_checkpoints(ckpt_dir) if s < step]
    previous = "there is no earlier checkpoint"
    if older:
        previous = f"the previous checkpoint {older[0]} is untouched"
    return CheckpointWriteError(
        f"could not write checkpoint {final} (step {step}): {'; '.join(why)}. Nothing was "
        f"committed and {previous}; the unfinished save in {tmp} is removed at the next "
        f"start. {fix}"
    )


def timestamp() -> str:
    """A sortable local time for names of things moved aside, e.g. 20250101-120000."""
    return time.strftime("%Y%m%d-%H%M%S")


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


def quick_check(path: str) -> str | None:
    """Why checkpoint `path` is not intact by its metadata.json (missing, unreadable, a listed
    file missing or of the wrong size), or None: stat calls only, no hashing."""
    try:
        _check_sizes(path, read_metadata(path))
    except (CheckpointError, OSError, KeyError, TypeError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def prune(ckpt_dir: str, keep: int, newest_step: int | None = None):
    """Delete intact checkpoints beyond the newest `keep` intact ones, never one newer than
    `newest_step` (the save just made), never the one `latest` names and never one that fails
    quick_check (it is kept for inspection) -> (removed paths, [(kept path, why)])."""
    latest = read_latest(ckpt_dir)
    intact, damaged = [], []
    for step, path in list_checkpoints(ckpt_dir):
        if newest_step is not None and step > newest_step:
            continue
        why = quick_check(path)
        if why is None:
            intact.append(path)
        else:
            damaged.append((path, why))
    removed = []
    for path in intact[keep:]:
        if latest is None or os.path.abspath(path) != os.path.abspath(latest):
            shutil.rmtree(path, ignore_errors=True)  # a half-removed one is damaged: kept
            removed.append(path)
    return removed, damaged


def read_latest(ckpt_dir: str) -> str | None:
    """The checkpoint directory `latest` points at, or None; CheckpointError when `latest`
    holds anything but a step_<N> name (it is written whole, so that is damage)."""
    file = os.path.join(ckpt_dir, LATEST)
    try:
        with open(file, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as e:  # a directory, unreadable
        raise _bad_latest(file, f"cannot be read ({e.strerror})") from None
    name = raw.decode("utf-8", "replace").strip()
    if not name:
        return None
    if not _STEP_DIR.match(name):
        raise _bad_latest(file, f"holds {name[:80]!r}, not the name of a checkpoint (step_<N>)")
    return os.path.join(ckpt_dir, name)


def _bad_latest(file: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{file} {why}: a save writes it whole, so it is damaged. Fix: name the checkpoint "
        f"itself (train.resume={os.path.dirname(file)}/step_<N>), or use train.resume=auto, "
        "which does not read it (it takes the newest valid committed step)"
    )


def read_metadata(path: str) -> dict:
    """Checkpoint `path`'s metadata.json, checked for its shape (metadata_json.py);
    CheckpointError naming the file when it is missing, not JSON, or of another shape."""
    file = os.path.join(path, METADATA)
    try:
        with open(file, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{file} does not exist: {path} is not a complete megatron_lite checkpoint. "
            "Fix: point at a step_<N> directory (or a checkpoint folder with a `latest` file)"
        ) from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested beyond parsing
        raise metadata_json.damaged(file, f"it is not JSON ({e})") from None
    except IsADirectoryError:
        raise metadata_json.damaged(file, "it is a directory") from None
    if isinstance(meta, dict) and "format" in meta and meta["format"] != FORMAT:
        raise CheckpointError(
            f"{file}: format {meta['format']!r}, expected {FORMAT!r}: not a checkpoint this "
            "version of megatron_lite wrote. Fix: resume from a checkpoint it wrote, or "
            "convert this one with the version that wrote it"
        )
    return metadata_json.check(file, meta, path)


def _damaged(file: str, why: str) -> CheckpointError:
    fix = "Fix: resume from an older checkpoint (train.resume=auto picks the newest valid one)"
    return CheckpointError(f"checkpoint file {file} {why}. {fix}")


def _check_sizes(path: str, meta: dict) -> None:
    for name, want in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise _damaged(file, "is missing")
        size = os.path.getsize(file)
        if size != want["bytes"]:
            raise _damaged(file, f"is truncated or damaged: {size} bytes, expected {want['bytes']}")


def _check_file(path: str, name: str, want: dict, ranges=None) -> None:
    """sha256 of file `name` (whole, or the items among `ranges`, default all items)."""
    file = os.path.join(path, name)
    if "items" not in want:
        if sha256_file(file) != want["sha256"]:
            raise _damaged(file, "is damaged: sha256 mismatch")
        return
    items = want["items"]
    wanted = [(int(o), n) for o, (n, _) in items.items()] if ranges is None else ranges
    wanted = sorted(set(wanted))
    for offset, length in wanted:
        row = items.get(str(offset))
        if row is None or row[0] != length:
            raise _damaged(file, f"has no checksummed item of {length} bytes at {offset}")
    got = range_hashes(file, wanted)  # one open of the file for all of them
    for offset, _ in wanted:
        if got[str(offset)][1] != items[str(offset)][1]:
            raise _damaged(file, f"is damaged: sha256 mismatch in the item at byte {offset}")


def verify(path: str, part: tuple[int, int] = (0, 1)) -> dict:
    """Read metadata.json and check the listed files' sizes and sha256 (this rank's share of
    them when `part` = (rank, world)); returns the metadata or raises CheckpointError naming
    the first damaged, truncated or missing file."""
    meta = read_metadata(path)
    _check_sizes(path, meta)
    for name in share(meta["files"], part):
        _check_file(path, name, meta["files"][name])
    return meta


def verify_reads(
    path: str, reads: dict[str, list[tuple[int, int]]], meta: dict | None = None
) -> dict:
    """What resume checks on each rank: every listed file's size (stat only), and the sha256
    of exactly the bytes this rank reads, `reads` = {file: [(offset, length)]} (a whole file
    when it was checksummed whole, e.g. DCP's `.metadata`). Returns the metadata or raises
    CheckpointError naming the first damaged, truncated or missing file. `meta`: the
    metadata.json already read."""
    meta = read_metadata(path) if meta is None else meta
    _check_sizes(path, meta)
    for name in sorted(reads):
        want = meta["files"].get(name)
        if want is None:
            raise _damaged(os.path.join(path, name), "is not listed in metadata.json")
        _check_file(path, name, want, reads[name])
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
    """resume=auto's order of preference: committed checkpoints by step, newest first.
    `latest` is not consulted: a crash between a commit and the `latest` update leaves it
    naming an older step."""
    return [p for _, p in list_checkpoints(ckpt_dir)]


def select_auto(ckpt_dir: str, candidates: list[str] | None = None, check=verify):
    """resume=auto: the first of `candidates` (default: auto_candidates) that `check` accepts,
    and messages about every damaged one skipped on the way -> (path | None, notes); None only
    when there are no candidates. When every candidate is damaged, raises CheckpointError
    listing each and why: starting from scratch would save over them."""
    if candidates is None:
        candidates = auto_candidates(ckpt_dir)
    notes, damaged = [], []
    for path in candidates:
        try:
            check(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            why = str(e).split(" Fix: ")[0].rstrip(". ")
            damaged.append(f"{os.path.basename(path)}: {why}")
            notes.append(f"skipping damaged checkpoint {path} (kept): {e}")
            continue
        if notes:
            notes.append(f"falling back to the newest valid checkpoint {path}")
        return path, notes
    if damaged:
        raise CheckpointError(
            f"train.resume=auto: none of the {len(damaged)} checkpoints in {ckpt_dir} is "
            f"valid, so the run does not start over them (nothing was deleted): "
            f"{' | '.join(damaged)}. Fix: resume from a good copy with train.resume=<path>, "
            "or start afresh with train.resume=none train.overwrite=true (moves them aside)"
        )
    return None, notes


def stale_temporaries(ckpt_dir: str) -> list[str]:
    """Leftovers of saves that died: `.tmp-step_<N>` directories and `latest.tmp.*` files."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(
        os.path.join(ckpt_dir, n)
        for n in os.listdir(ckpt_dir)
        if n.startswith(".tmp-step_") or n.startswith(LATEST + ".tmp.")
    )
