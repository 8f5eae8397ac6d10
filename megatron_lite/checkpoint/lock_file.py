"""What a run directory's lock file holds (`<out_dir>/run.lock`, see run_dir.py), and reading
and writing it.

A run writes its lock as a JSON object {host, pid, slurm_job_id, start_ticks, since}, linked
into place complete (never torn). Reading accepts exactly that: anything else at that path (not
JSON, another JSON value, a missing key or a value of the wrong type or range, a directory, a
symbolic link, a FIFO, a file too large to be a lock, one that cannot be read) is no run's
lock, so it cannot say whether a run uses the directory: RunDirError names the file, what is
wrong with it and the command that clears it. Nothing here guesses or takes such a file over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import socket
import stat
import time

from megatron_lite.checkpoint.errors import RunDirError


@dataclasses.dataclass
class Holder:
    """Who holds a run directory's lock."""

    host: str
    pid: int
    slurm_job_id: str | None
    start_ticks: int | None  # the process start time (/proc), against pid reuse
    since: str

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        return cls(
            socket.gethostname(),
            pid,
            os.environ.get("SLURM_JOB_ID"),
            process_start_ticks(pid),
            time.strftime("%Y-%m-%d %H:%M:%S"),
        )

    def describe(self) -> str:
        job = self.slurm_job_id or "none"
        return f"host {self.host}, pid {self.pid}, Slurm job {job}, since {self.since}"

    def same_process(self, other: Holder) -> bool:
        return (self.host, self.pid, self.start_ticks) == (other.host, other.pid, other.start_ticks)


def process_start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot, None when unknown (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])  # a zombie has ended


def alive(pid: int, start_ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    now = process_start_ticks(pid)
    if now is None:
        return not os.path.isdir("/proc")  # no /proc: trust kill(0); on Linux: a zombie
    return start_ticks is None or now == start_ticks


PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT: no process on any host has a larger pid
LOCK_MAX_BYTES = 1 << 16  # a lock is ~150 bytes; a larger file is not one


def _damaged(lock: str, what: str, remove: str = "rm") -> RunDirError:
    """A lock file that no run wrote: say what is wrong with it, and how to clear it."""
    directory = os.path.dirname(lock)
    return RunDirError(
        f"the run directory lock {lock} {what}: a run's lock is a JSON object {{host, pid, "
        f"slurm_job_id, start_ticks, since}} written by the run holding {directory}, so this "
        f"one cannot tell whether a run uses that directory. Fix: if no run uses {directory}, "
        f"remove it (`{remove} {shlex.quote(lock)}`) and start again"
    )


def _holder_from(data, lock: str) -> Holder:
    """The Holder a lock file's JSON describes, or RunDirError naming what is wrong with it."""
    if not isinstance(data, dict):
        raise _damaged(lock, f"holds a JSON {_json_type(data)}, not an object")
    missing = [f.name for f in dataclasses.fields(Holder) if f.name not in data]
    if missing:
        raise _damaged(lock, f"has no {', '.join(missing)}")
    rules = {  # field: (ok, the rule)
        "host": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
        "pid": (lambda v: _is_int(v) and 1 <= v <= PID_MAX, f"an integer from 1 to {PID_MAX}"),
        "slurm_job_id": (lambda v: v is None or isinstance(v, str), "a string or null"),
        "start_ticks": (lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 or null"),
        "since": (lambda v: isinstance(v, str), "a string"),
    }
    for name, (ok, rule) in rules.items():
        if not ok(data[name]):
            raise _damaged(lock, f"has {name}={data[name]!r}, which must be {rule}")
    return Holder(**{f.name: data[f.name] for f in dataclasses.fields(Holder)})


def _json_type(v) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_lock(lock: str) -> Holder | None:
    """The holder the lock file names; None when there is none (released meanwhile).
    RunDirError when the path holds anything but a lock a run wrote: never a guess."""
    try:
        st = os.lstat(lock)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _damaged(lock, f"cannot be examined ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(lock)
        raise _damaged(lock, f"is a symbolic link (to {target!r}), not a file a run wrote")
    if stat.S_ISDIR(st.st_mode):
        raise _damaged(lock, "is a directory, not a file", remove="rm -r")
    if not stat.S_ISREG(st.st_mode):
        raise _damaged(lock, "is not a regular file (a FIFO, socket or device)")
    if st.st_size > LOCK_MAX_BYTES:
        raise _damaged(lock, f"is {st.st_size} bytes long, not a lock (a few hundred bytes)")
    try:  # O_NOFOLLOW | O_NONBLOCK: a path swapped for a link or FIFO meanwhile never blocks
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            raw = os.read(fd, LOCK_MAX_BYTES + 1)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _damaged(lock, f"cannot be read ({e.strerror})", remove="rm -f") from None
    if not raw.strip():
        raise _damaged(lock, "is empty")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _damaged(lock, "is not UTF-8 text") from None
    except ValueError as e:
        raise _damaged(lock, f"is not JSON ({e})") from None
    return _holder_from(data, lock)


def write_lock(lock: str, me: Holder, replace: bool) -> None:
    """A complete lock file, linked into place (fails if one exists) or replacing one."""
    tmp = f"{lock}.{me.pid}.tmp"
    try:
        try:
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(me), f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # e.g. no space left: name the file
            raise OSError(e.errno, e.strerror, tmp) from None
        if replace:
            os.replace(tmp, lock)
        else:
            os.link(tmp, lock)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
