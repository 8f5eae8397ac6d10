"""Where tools/convert_checkpoint.py writes: the rules that keep a user's files safe.

- The output is a directory that does not exist yet, an empty one, or (with --overwrite) one
  this converter wrote earlier, recognized by its marker file `.megatron_lite_convert.json`.
  Anything else (a non-empty directory we did not write, a file, a symbolic link) is refused,
  and so is an output inside a run's checkpoint folder (even with --overwrite: a training
  resume would read it) or one that holds or lies inside the input.
- A conversion writes into a fresh temporary sibling `.<name>.convert-<random>` (mkdtemp, so
  never a name a user owns) and renames it into place: onto a missing or empty output with
  one rename; over an earlier output of ours by an atomic exchange (Linux renameat2
  RENAME_EXCHANGE), after which the old output, now at the temporary name, is removed. So a
  kill -9 at any moment leaves the old output intact or the new one complete, never a mix.
- Nothing is deleted or moved that this call did not create, except a leftover temporary of
  an earlier conversion that was killed: named as ours, holding our marker, written by a
  process on this host that is gone; it is removed when the next conversion to the same output
  starts (one whose output is missing keeps it, and the warning says how to restore it).
- A failed write (disk full, file-size limit, permissions) removes the temporary and raises
  CheckpointWriteError naming the file and the errno; the old output is untouched.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile

from megatron_lite.checkpoint import files, run_dir
from megatron_lite.checkpoint.errors import CheckpointError, CheckpointWriteError
from megatron_lite.checkpoint.lock_file import Holder, alive

MARKER = ".megatron_lite_convert.json"
WRITTEN_BY = "megatron_lite tools/convert_checkpoint.py"
KILL_AT_ENV = "MEGATRON_LITE_CONVERT_KILL_AT"  # test hook: SIGKILL ourselves at a named point
_TMP_PART = ".convert-"
_OLD = "old-"  # the old output, moved aside where no atomic exchange exists


def kill_point(name: str) -> None:
    """Fault-test hook: die by SIGKILL here when $MEGATRON_LITE_CONVERT_KILL_AT names `name`."""
    if os.environ.get(KILL_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _refuse(out: str, why: str, fix: str) -> CheckpointError:
    return CheckpointError(f"output {out} {why}. Fix: {fix}")


# ------------------------------------------------------------------ what the output may be
def read_marker(path: str) -> dict | None:
    """The marker of a directory this converter wrote, or None (absent, or not ours)."""
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            data = json.loads(f.read(1 << 16).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == WRITTEN_BY else None


def run_checkpoint_folder(path: str) -> str | None:
    """The run checkpoint folder that `path` lies inside (an ancestor holding `latest`, a
    step_<N> checkpoint or an unfinished save, or named checkpoints/ in a run directory)."""
    here = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            names = set(os.listdir(here))
        except OSError:
            names = set()
        parent = os.path.dirname(here)
        in_run = os.path.basename(here) == "checkpoints" and any(
            os.path.exists(os.path.join(parent, n)) for n in (run_dir.LOCK, *run_dir.RUN_FILES)
        )
        if in_run or files.LATEST in names or files.list_checkpoints(here):
            return here
        if files.stale_temporaries(here):
            return here
        if parent == here:
            return None
        here = parent


def _inside(a: str, b: str) -> bool:
    """Whether path a is b or lies inside it (real paths)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def check_output(out: str, overwrite: bool, inputs: tuple[str, ...] = ()) -> str:
    """Refuse an output the rules above forbid (CheckpointError naming it and the fix);
    returns what is there now: "missing", "empty" or "ours"."""
    if not out or out.strip() == "":
        raise _refuse(repr(out), "is empty", "name a new directory")
    folder = run_checkpoint_folder(out)
    if folder is not None:
        raise _refuse(
            out,
            f"is inside the run checkpoint folder {folder}: a run's resume would read it, "
            "and a conversion there could replace a training checkpoint (--overwrite does not "
            "change this)",
            "write the converted model outside that folder, e.g. next to the run directory",
        )
    for src in inputs:
        if _inside(out, src) or _inside(src, out):
            raise _refuse(out, f"is, holds or lies inside the input {src}", "use another path")
    state = _state(out)
    if state == "ours" and not overwrite:
        raise _refuse(
            out,
            "is a non-empty directory (an earlier output of this converter)",
            "choose a new or empty directory, or pass --overwrite to replace it",
        )
    if state == "not ours":
        raise _refuse(
            out,
            f"is a non-empty directory that this converter did not write (it has no {MARKER})",
            "choose a new or empty directory; --overwrite replaces only a directory the "
            "converter wrote itself, so move this one away yourself if it is to be replaced",
        )
    return state


def _state(out: str) -> str:
    if os.path.islink(out):
        raise _refuse(out, "is a symbolic link", "give the real directory, or a new path")
    if not os.path.lexists(out):
        parent = _existing_ancestor(os.path.dirname(os.path.abspath(out)))
        if not os.path.isdir(parent):
            raise _refuse(out, f"cannot be created: {parent} is not a directory", "fix the path")
        return "missing"
    if not os.path.isdir(out):
        raise _refuse(out, "exists and is not a directory", "name a directory to create")
    try:
        entries = os.listdir(out)
    except OSError as e:
        raise _refuse(out, f"cannot be listed ({e.strerror})", "check its permissions") from None
    if not entries:
        return "empty"
    return "ours" if read_marker(out) is not None else "not ours"


def _existing_ancestor(path: str) -> str:
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


# ------------------------------------------------------------------ temporaries
def _tmp_prefix(out: str) -> str:
    return f".{os.path.basename(os.path.abspath(out))}{_TMP_PART}"


def _leftovers(out: str) -> list[str]:
    parent = os.path.dirname(os.path.abspath(out))
    prefix = _tmp_prefix(out)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    pattern = re.compile(re.escape(prefix) + r"(old-)?[A-Za-z0-9_]{8}$")
    return sorted(os.path.join(parent, n) for n in names if pattern.match(n))


def clean_leftovers(out: str) -> list[str]:
    """Remove leftovers of earlier conversions to `out` that were killed: temporaries named so
    and holding our marker, either complete (a staged output never placed, or an old output
    swapped out but not yet removed) while `out` exists, or unfinished and written on this
    host by a process that is gone. Returns warnings about the ones kept."""
    notes = []
    for path in _leftovers(out):
        marker = read_marker(path)
        if marker is None:
            notes.append(
                f"kept {path}: it is named like a temporary of a conversion to {out} but holds "
                f"no {MARKER}; remove it if nothing of yours is in it"
            )
        elif _is_old(path, out) and not os.path.isdir(out):
            notes.append(
                f"{out} is missing and {path} holds its earlier content (a replacement was "
                f"interrupted): restore it with mv {path} {out}"
            )
        elif _is_old(path, out) or marker.get("complete") is True:
            remove_ours(path)
        elif _writer_gone(marker):
            remove_ours(path)
        else:
            notes.append(f"kept {path}: a conversion to {out} may still be writing it")
    return notes


def _is_old(path: str, out: str) -> bool:
    return os.path.basename(path).startswith(_tmp_prefix(out) + _OLD)


def _writer_gone(marker: dict) -> bool:
    try:
        holder = Holder(**marker.get("writer"))
    except TypeError:
        return False
    return holder.host == Holder.me().host and not alive(holder.pid, holder.start_ticks)


def remove_ours(path: str) -> None:
    """Remove a directory this converter wrote, its marker last (so a kill midway leaves it
    recognizably ours)."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name == MARKER:
            continue
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.remove(full)
        kill_point("removing")
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, MARKER))
    os.rmdir(path)


def write_marker(tmp: str, command: str, source: str, complete: bool) -> None:
    from megatron_lite.atomic import write_atomic

    body = {
        "written_by": WRITTEN_BY,
        "command": command,
        "source": os.path.abspath(source),
        "complete": complete,
        "writer": dataclasses.asdict(Holder.me()),
    }
    write_atomic(os.path.join(tmp, MARKER), json.dumps(body, indent=1))


# ------------------------------------------------------------------ renames
_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """Linux renameat2; False when this system or file system lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def place(tmp: str, out: str, state: str) -> None:
    """Rename the complete temporary `tmp` into place as `out` (see the module docstring)."""
    if _state(out) != state:  # changed since the check: someone else writes there
        raise _refuse(out, "changed while converting", "run the conversion again")
    if state == "missing":
        if not _renameat2(tmp, out, _RENAME_NOREPLACE):
            os.rename(tmp, out)
        return
    if state == "empty":
        os.rename(tmp, out)  # fails if it is no longer empty
        return
    if _renameat2(tmp, out, _RENAME_EXCHANGE):  # tmp now holds the old output
        kill_point("placed")
        remove_ours(tmp)
        return
    old = tempfile.mkdtemp(
        prefix=_tmp_prefix(out) + _OLD, dir=os.path.dirname(os.path.abspath(out))
    )
    os.rename(out, old)  # no atomic exchange here (e.g. NFS): a short window without `out`
    kill_point("placed")
    os.rename(tmp, out)
    remove_ours(old)


# ------------------------------------------------------------------ staging
@contextlib.contextmanager
def staged_output(out: str, overwrite: bool, command: str, source: str, inputs=()):
    """Yield a fresh temporary sibling of `out` to write the whole output into; on success
    mark it complete and place it, on any failure remove it (the old output is untouched)."""
    state = check_output(out, overwrite, inputs)
    for note in clean_leftovers(out):
        print(f"warning: {note}", file=sys.stderr)
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=_tmp_prefix(out), dir=parent)
    except OSError as e:
        raise CheckpointWriteError(
            f"cannot create a directory in {parent} for output {out}: {e.strerror}. Fix: "
            "make it writable, or choose another output"
        ) from None
    try:
        write_marker(tmp, command, source, complete=False)
        kill_point("staged")
        yield tmp
        write_marker(tmp, command, source, complete=True)
        kill_point("complete")
        place(tmp, out, state)
    except BaseException as e:
        failure = write_failure(e, tmp, out)  # before the removal: it may look at the files
        with contextlib.suppress(OSError):
            if os.path.isdir(tmp):
                remove_ours(tmp)
        if failure is None:
            raise
        raise failure from None


_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def writing(file: str):
    """Name `file` in the OSError of a failed write whose library did not (safetensors
    reports "(os error N)" text and removes the file)."""
    try:
        yield
    except Exception as e:
        found = _errno_of(e)
        if found is None or isinstance(found, OSError) and found.filename:
            raise
        code = found if isinstance(found, int) else found.errno
        raise OSError(code, os.strerror(code), file) from e


def write_failure(e: BaseException, tmp: str, out: str) -> CheckpointWriteError | None:
    """The user-facing error of a failed write into `tmp` (staging `out`), naming the file
    (in `tmp`, which the caller removes); None when `e` is
    not an I/O failure (a bug: it propagates). torch's DCP writer reports a failed write as
    "[enforce fail ...] unexpected pos" with no errno, and safetensors as "(os error N)" text."""
    if isinstance(e, CheckpointError):
        return e if isinstance(e, CheckpointWriteError) else None
    found = _errno_of(e)
    file = getattr(found, "filename", None) if isinstance(found, OSError) else None
    code = found.errno if isinstance(found, OSError) else found
    big = _over_size_limit(tmp)
    if code is None and big is not None:
        code, file = errno.EFBIG, big
    if code is None:
        from megatron_lite.atomic import write_failure as by_free_space

        full = by_free_space(RuntimeError(), os.path.join(tmp, "x"))
        code = full.errno if full is not None else None
    if code is None:
        return None
    file = file or big or tmp
    return CheckpointWriteError(
        f"could not write {file}: {os.strerror(code)} (errno {errno.errorcode.get(code, code)})"
        f". Output {out} was not written (it is as it was before; the temporary directory is "
        "removed). Fix: free space or raise the file-size limit (ulimit -f), or choose an "
        "output on another file system"
    )


def _errno_of(e: BaseException):
    """An OSError with an errno in e's chain (DCP's CheckpointException: in its failures), or
    the errno in safetensors' message, or None."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None:
            return x
        m = _OS_ERROR_TEXT.search(str(x))
        if m:
            return int(m.group(1))
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        todo += [x.__cause__, x.__context__]
    return None


def _over_size_limit(tmp: str) -> str | None:
    """A file under `tmp` as large as the file-size limit (RLIMIT_FSIZE): the one that hit it."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft == resource.RLIM_INFINITY or not os.path.isdir(tmp):
        return None
    for root, _, names in os.walk(tmp):
        for n in names:
            with contextlib.suppress(OSError):
                if os.path.getsize(os.path.join(root, n)) >= soft:
                    return os.path.join(root, n)
    return None
