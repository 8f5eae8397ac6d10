"""A hostile user's table of `run.lock` contents: every lock file a run did not write is
refused (RunDirError: exit 2 through the CLI) with one message that names the file and what is
wrong with it, blames no other run, leaves the file as it was, and gives a fix that works: the
command in the message is run here, and the next claim succeeds."""

import dataclasses
import errno
import json
import os
import re
import socket
import subprocess

import pytest

from megatron_lite.checkpoint import lock_file, run_dir
from megatron_lite.checkpoint.run_dir import Holder, RunDirError, claim_run_dir
from megatron_lite.config import load_config

GOOD = {
    "host": socket.gethostname(),
    "pid": 1,
    "slurm_job_id": None,
    "start_ticks": None,
    "since": "2025-01-01 00:00:00",
}


def _json(**changes) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def _without(key) -> bytes:
    return json.dumps({k: v for k, v in GOOD.items() if k != key}).encode()


# (case id, the lock file's bytes or how the fixture makes it, what the message must say)
CASES = [
    ("garbage", b"not a lock at all\n", "is not JSON"),
    ("torn-json", _json()[:-9], "is not JSON"),
    ("empty", b"", "is empty"),
    ("blank", b" \n\t\n", "is empty"),
    ("not-utf8", b"\xff\xfe\x00\x81", "is not UTF-8"),
    ("json-array", b"[1, 2]", "holds a JSON array"),
    ("json-string", b'"pid 12"', "holds a JSON string"),
    ("json-number", b"12", "holds a JSON number"),
    ("json-null", b"null", "holds a JSON null"),
    ("no-pid", _without("pid"), "has no pid"),
    ("no-host", _without("host"), "has no host"),
    ("empty-object", b"{}", "has no host, pid, slurm_job_id, start_ticks, since"),
    ("pid-string", _json(pid="123"), "pid='123'"),
    ("pid-huge", _json(pid=10**30), f"pid={10**30}"),
    ("pid-above-limit", _json(pid=lock_file.PID_MAX + 1), f"pid={lock_file.PID_MAX + 1}"),
    ("pid-negative", _json(pid=-5), "pid=-5"),
    ("pid-zero", _json(pid=0), "pid=0"),
    ("pid-bool", _json(pid=True), "pid=True"),
    ("pid-float", _json(pid=12.5), "pid=12.5"),
    ("pid-null", _json(pid=None), "pid=None"),
    ("host-empty", _json(host=""), "host=''"),
    ("host-number", _json(host=7), "host=7"),
    ("job-number", _json(slurm_job_id=17), "slurm_job_id=17"),
    ("ticks-negative", _json(start_ticks=-1), "start_ticks=-1"),
    ("ticks-string", _json(start_ticks="soon"), "start_ticks='soon'"),
    ("since-null", _json(since=None), "since=None"),
    ("huge-file", b" " * (lock_file.LOCK_MAX_BYTES + 1), "bytes long"),
    ("directory", "mkdir", "is a directory"),
    ("dangling-symlink", "symlink to nowhere", "is a symbolic link"),
    ("symlink-to-lock", "symlink to a good lock", "is a symbolic link"),
    ("fifo", "mkfifo", "is not a regular file"),  # would block an open() forever
    ("unreadable", "unreadable", "cannot be read (Permission denied)"),
]
BLAME = ("in use by another run", "keeps changing hands", "Fix: stop the other runs")


def _plant(directory, how, monkeypatch) -> str:
    lock = os.path.join(directory, run_dir.LOCK)
    if isinstance(how, bytes):
        with open(lock, "wb") as f:
            f.write(how)
    elif how == "mkdir":
        os.mkdir(lock)
        open(os.path.join(lock, "inside"), "w").close()
    elif how == "symlink to nowhere":
        os.symlink(os.path.join(directory, "gone"), lock)
    elif how == "symlink to a good lock":
        with open(os.path.join(directory, "elsewhere.json"), "wb") as f:
            f.write(_json())
        os.symlink("elsewhere.json", lock)
    elif how == "mkfifo":
        os.mkfifo(lock)
    elif how == "unreadable":
        with open(lock, "wb") as f:
            f.write(_json())
        os.chmod(lock, 0)
        real = os.open  # root reads it anyway: make os.open answer as for anyone else

        def no_read(path, flags, *a, **k):
            if os.fspath(path) == lock:
                raise PermissionError(13, "Permission denied", lock)
            return real(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", no_read)
    return lock


def _snapshot(lock: str):
    if os.path.islink(lock):
        return ("link", os.readlink(lock))
    if os.path.isdir(lock):
        return ("dir", sorted(os.listdir(lock)))
    st = os.lstat(lock)
    if not os.path.isfile(lock):
        return ("special", st.st_mode)
    with open(lock, "rb") as f:
        return ("file", f.read())


@pytest.mark.parametrize("case, how, needle", CASES, ids=[c[0] for c in CASES])
def test_a_lock_no_run_wrote_is_named_and_the_fix_works(tmp_path, monkeypatch, case, how, needle):
    cfg = load_config(None, ["data.mock=true", f"train.out_dir={tmp_path}"])
    lock = _plant(str(tmp_path), how, monkeypatch)
    before = _snapshot(lock)
    with pytest.raises(RunDirError) as e:
        claim_run_dir(cfg, rank=0, world=1)
    msg = str(e.value)
    assert lock in msg and needle in msg and "Fix:" in msg, msg
    assert not any(b in msg for b in BLAME), f"blames another run: {msg}"
    assert _snapshot(lock) == before, "a refused run changed the lock file"
    monkeypatch.undo()  # the fix is run as the user would: os.open as it is
    fix = re.search(r"`([^`]+)`", msg.split("Fix:", 1)[1])
    assert fix, msg
    subprocess.run(fix.group(1), shell=True, check=True, timeout=10)
    held = claim_run_dir(cfg, rank=0, world=1)  # the fix worked: the directory is free
    assert held.owned
    held.release()
    assert not os.path.lexists(lock)


def test_a_takeover_mutex_that_is_a_file_is_named(tmp_path):
    """`run.lock.takeover` exists only as a directory, for a moment; a file of that name
    beside a stale lock is named (not `rmdir`ed into a NotADirectoryError)."""
    cfg = load_config(None, ["data.mock=true", f"train.out_dir={tmp_path}"])
    stale = dataclasses.replace(Holder.me(), pid=_dead_pid(), start_ticks=None)
    (tmp_path / run_dir.LOCK).write_text(json.dumps(dataclasses.asdict(stale)))
    mutex = tmp_path / run_dir.TAKEOVER
    mutex.write_text("")
    with pytest.raises(RunDirError) as e:
        claim_run_dir(cfg, rank=0, world=1)
    msg = str(e.value)
    assert str(mutex) in msg and "is not a directory" in msg and "Fix:" in msg, msg
    subprocess.run(re.search(r"`([^`]+)`", msg).group(1), shell=True, check=True, timeout=10)
    claim_run_dir(cfg, rank=0, world=1).release()  # takes the stale lock over now


def test_a_lock_damaged_during_the_run_is_left_at_release(tmp_path):
    """Release removes only the run's own lock: one changed since is left, and release does
    not raise (it runs at the end of training, where an error would lose the exit code)."""
    lock = run_dir.RunLock([str(tmp_path)])
    lock.acquire()
    (tmp_path / run_dir.LOCK).write_text("overwritten by hand")
    lock.release()
    assert (tmp_path / run_dir.LOCK).read_text() == "overwritten by hand"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _full_disk(monkeypatch, name: str):
    """fsync of the file `name` (its temporary: `name`.*) fails with ENOSPC: the lock and
    the run files are fsynced before they are linked or renamed into place."""
    fsync = os.fsync

    def no_space(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", no_space)


@pytest.mark.parametrize("what", ["run.lock", "config.yaml"])
def test_a_full_disk_names_the_file_and_leaves_nothing_behind(tmp_path, monkeypatch, what):
    """The lock, or the run files train.main writes right after it (`then`), on a full
    disk: exit 2 naming the file and "no space left", with a fix that says so; no temporary
    file is left and the lock is not held."""
    from megatron_lite.config import save_config

    cfg = load_config(None, ["data.mock=true", f"train.out_dir={tmp_path}"])
    config_yaml = str(tmp_path / "config.yaml")
    then = None
    if what == "config.yaml":
        lock = run_dir.RunLock([str(tmp_path)])  # taken before the disk is full
        lock.acquire()
        then = lambda: save_config(cfg, config_yaml)  # noqa: E731
    _full_disk(monkeypatch, what)
    with pytest.raises(RunDirError) as e:
        claim_run_dir(cfg, rank=0, world=1, then=then)
    msg = str(e.value)
    assert "No space left on device" in msg and "Fix: free space on that disk" in msg, msg
    assert (str(tmp_path / "run.lock") if what == "run.lock" else config_yaml) in msg, msg
    monkeypatch.undo()
    if what == "config.yaml":
        lock.release()
    assert os.listdir(tmp_path) == [], "a temporary file or the lock was left behind"
