"""Output paths checked before launch: every directory a run writes must be creatable or
writable, so a bad path is one message up front instead of a traceback on every rank later.

Validation only looks: nothing here creates a directory.
"""

from __future__ import annotations

import os

from megatron_lite.config import Config
from megatron_lite.validation.rules import _rule

# the longest tail a writer appends to a file name (IndexedDatasetBuilder's temporaries)
TMP_SUFFIX = ".idx.tmp.4194304"


def _limit(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def _existing_ancestor(path: str) -> str:
    """The deepest existing path on the way up from `path` (a file, a directory or a link)."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def output_dir_problem(path: str, file_name: str = "") -> str | None:
    """Why the directory `path` cannot be created or written (None if it can); `file_name` is
    the longest name to be written into it. Works for root too, except the permission case:
    os.access says what the kernel lets this user write, which for root is nearly everything."""
    if path == "":
        return "is empty"
    full = os.path.abspath(path)
    anchor = _existing_ancestor(full)
    name_max = _limit(anchor if os.path.isdir(anchor) else "/", "PC_NAME_MAX", 255)
    path_max = _limit("/", "PC_PATH_MAX", 4096)
    size = len(os.fsencode(os.path.join(full, file_name)))
    if size >= path_max:
        return f"gives a {size}-byte absolute path; the limit is {path_max - 1} bytes (PATH_MAX)"
    for part in os.fsencode(full).split(b"/"):
        if len(part) > name_max:
            return (
                f"has a {len(part)}-byte name {part[:20].decode(errors='replace')}...; the "
                f"limit is {name_max} bytes (NAME_MAX)"
            )
    if len(os.fsencode(file_name)) > name_max:
        return (
            f"would hold the {len(os.fsencode(file_name))}-byte file name "
            f"{file_name[:20]}...; the limit is {name_max} bytes (NAME_MAX)"
        )
    if os.path.islink(anchor) and not os.path.exists(anchor):
        return f"runs through the broken symbolic link {anchor}"
    if not os.path.isdir(anchor):
        if anchor == full:
            return "exists and is a file, not a directory"
        return f"lies under {anchor}, which is a file, not a directory"
    if not os.access(anchor, os.W_OK | os.X_OK):
        what = "exists but is" if anchor == full else f"cannot be created: {anchor} is"
        return f"{what} not writable by this user"
    return None


def output_prefix_problem(prefix: str) -> str | None:
    """Why `<prefix>.bin/.idx` (and their temporaries) cannot be written, or None."""
    name = os.path.basename(prefix)
    if not name:
        return "does not end in a file name prefix"
    for ext in (".bin", ".idx"):
        if os.path.isdir(prefix + ext):
            return f"{prefix + ext} is a directory"
    parent = os.path.dirname(os.path.abspath(prefix))
    problem = output_dir_problem(parent, file_name=name + TMP_SUFFIX)
    return None if problem is None else f"its directory {parent} {problem}"


def check_output_dir(key: str, path: str, fix: str) -> None:
    """ConfigError naming the key, the path, what is wrong and `fix` if `path` is not usable."""
    problem = output_dir_problem(path)
    _rule(problem is None, key, path, f"{problem}", fix)


def _validate_output_paths(cfg: Config) -> None:
    """train.out_dir, the checkpoint directory (when saving) and data.cache_dir (when a corpus is
    prepared) are writable; an existing checkpoint directory is a directory."""
    t, d = cfg.train, cfg.data
    check_output_dir(
        "train.out_dir",
        t.out_dir,
        "choose a directory this user can create or write, e.g. train.out_dir=runs/my_run",
    )
    ckpt_dir = t.ckpt_dir if t.ckpt_dir is not None else os.path.join(t.out_dir, "checkpoints")
    fix = "choose a writable directory, e.g. train.ckpt_dir=runs/my_run/checkpoints"
    if t.ckpt_dir is None:
        fix = f"train.ckpt_dir is null, which means <out_dir>/checkpoints; {fix}"
    if t.save_interval > 0:
        check_output_dir("train.ckpt_dir", ckpt_dir, fix)
    else:  # only read (resume=auto), but a file there must not pass as "no checkpoints yet"
        _rule(
            not os.path.exists(ckpt_dir) or os.path.isdir(ckpt_dir),
            "train.ckpt_dir",
            ckpt_dir,
            "exists and is a file, not a directory",
            fix,
        )
    if not d.mock and d.index_cache_dir is not None:
        check_output_dir(
            "data.index_cache_dir",
            d.index_cache_dir,
            "point it at a writable directory that every rank of a machine sees",
        )
    if not d.mock and d.corpus is not None:
        check_output_dir(
            "data.cache_dir",
            d.cache_dir,
            "point it at a writable directory, e.g. data.cache_dir=.cache/megatron_lite",
        )
