"""One run per run directory: an exclusive lock, and what its holder does at the start.

    <out_dir>/run.lock     JSON {host, pid, slurm_job_id, start_ticks, since} of the holder
    <ckpt_dir>/run.lock    the same, when train.ckpt_dir lies outside train.out_dir

`claim_run_dir` (collective) is called by train.main right after the process group exists,
before anything is written into the run directory, and again by CheckpointDir (directory.py; a
no-op when this process already holds the lock, so a Trainer used without train.main is covered
too).
Rank 0 takes the lock: a fully written file is hard-linked into place (atomic, never torn,
fails if a lock exists); a stale one is replaced under a mkdir mutex (`run.lock.takeover/`,
atomic on network file systems too) so two runs cannot both take it over. The verdict is
broadcast, so a refused run stops on every rank (exit code 2 through the CLI): taking the
lock before the process group exists would leave the other ranks no way to hear of a refusal
(under srun they would wait in the rendezvous until its timeout). The lock is released when
training ends, after any async save has finished; a run that dies leaves it behind, and the
next run takes it over (with a warning) when it is stale:
- the holder ran on this host and its process is gone (pid dead, or reused: the process start
  time differs), or
- the holder ran on another host under the same SLURM_JOB_ID (the job was requeued; on the
  same host a live holder of the same job is a concurrent step, refused).
Anything else is refused, naming the holder and the fix; so is a lock file no run wrote
(lock_file.py: damaged, a directory, a link, ...), naming what is wrong with it.

Then the holder cleans leftovers of dead saves (`.tmp-step_<N>`, `latest.tmp.*`,
`metrics.jsonl.tmp.*`) and refuses to start a run that would not continue the checkpoints
already there (train.resume=none, or an older step than the newest) unless
train.overwrite=true, which moves them (and the old metrics.jsonl, config.yaml, rank_map.txt)
into `<out_dir>/overwritten-<time>/`. Nothing here deletes a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import shutil
import stat
import sys
import time

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.errors import CheckpointError, RunDirError
from megatron_lite.checkpoint.lock_file import Holder, alive, read_lock, write_lock
from megatron_lite.parallel import mappings
from megatron_lite.parallel.mappings import guarded

LOCK = "run.lock"
TAKEOVER = "run.lock.takeover"  # a directory: exists while one run replaces a stale lock
TAKEOVER_STALE_S = 30.0  # the mutex is held for milliseconds; older means its holder died
RUN_FILES = ("metrics.jsonl", "config.yaml", "rank_map.txt")  # what overwrite moves aside


def stale_reason(holder: Holder, me: Holder) -> str | None:
    """Why `holder`'s lock no longer protects a running job, as seen by `me`; None if it may."""
    if holder.host == me.host:
        if not alive(holder.pid, holder.start_ticks):
            return f"its process {holder.pid} on {holder.host} is gone"
        return None
    if holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id:
        return f"it was taken by this Slurm job {me.slurm_job_id} before it was requeued"
    return None


@contextlib.contextmanager
def _takeover_mutex(directory: str):
    """Mutual exclusion for replacing a stale lock: mkdir succeeds for one process only."""
    path = os.path.join(directory, TAKEOVER)
    deadline = time.monotonic() + 2 * TAKEOVER_STALE_S
    while True:
        try:
            os.mkdir(path)
            break
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise RunDirError(
                        f"{path} is not a directory: a run makes that directory for a moment "
                        f"while it takes over a stale lock of {directory}, and no run made "
                        f"this one. Fix: remove it (`rm {shlex.quote(path)}`) and start again"
                    ) from None
                if time.time() - os.stat(path).st_mtime > TAKEOVER_STALE_S:
                    os.rmdir(path)  # left by a run that died inside the mutex
                    continue
            if time.monotonic() > deadline:
                raise RunDirError(
                    f"{path} stays: another run keeps taking over the lock of {directory}. "
                    f"Fix: if no run uses that directory, remove {path}"
                ) from None
            time.sleep(0.05)
    try:
        yield
    finally:
        os.rmdir(path)


class RunLock:
    """The locks of a run's directories (rank 0); `owned` is False when this process already
    held them (taken by train.main: it releases them)."""

    def __init__(self, directories: list[str]):
        self.directories = directories
        self.me = Holder.me()
        self.owned = False

    def acquire(self) -> list[str]:
        """Take every lock or none; returns warnings about stale locks taken over."""
        warnings, taken = [], []
        try:
            for d in self.directories:
                owned, warning = self._acquire_one(d)
                if owned:
                    taken.append(d)
                if warning:
                    warnings.append(warning)
        except BaseException:
            for d in taken:
                self._release_one(d)
            raise
        self.owned = bool(taken)
        return warnings

    def _acquire_one(self, directory: str) -> tuple[bool, str | None]:
        os.makedirs(directory, exist_ok=True)
        lock = os.path.join(directory, LOCK)
        for _ in range(100):  # retried only when another run changed the lock meanwhile
            try:
                write_lock(lock, self.me, replace=False)
                return True, None
            except FileExistsError:
                pass
            holder = read_lock(lock)
            if holder is None:
                continue  # released meanwhile
            if holder.same_process(self.me):
                return False, None
            why = stale_reason(holder, self.me)
            if why is None:
                raise RunDirError(
                    f"run directory {directory} is in use by another run ({holder.describe()}; "
                    f"lock file {lock}). Two runs in one directory overwrite each other's "
                    "checkpoints and metrics. Fix: wait for that run to end (or stop it), or "
                    f"use another train.out_dir; if that process is gone, delete {lock}"
                )
            with _takeover_mutex(directory):
                if read_lock(lock) != holder:
                    continue  # another run took it over first: judge the new holder
                write_lock(lock, self.me, replace=True)
            return True, f"took over the stale lock {lock} ({holder.describe()}): {why}"
        raise RunDirError(f"the lock {lock} keeps changing hands. Fix: stop the other runs")

    def _release_one(self, directory: str) -> None:
        lock = os.path.join(directory, LOCK)
        try:
            holder = read_lock(lock)
        except RunDirError:  # changed since by someone else: not ours to remove
            return
        if holder is not None and holder.same_process(self.me):
            os.remove(lock)

    def release(self) -> None:
        """Remove the locks this process took (not one another run took over since)."""
        if self.owned:
            for d in self.directories:
                self._release_one(d)
            self.owned = False


def ckpt_dir_of(cfg) -> str:
    return cfg.train.ckpt_dir or os.path.join(cfg.train.out_dir, "checkpoints")


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return os.path.commonpath([path, directory]) == directory


def lock_directories(cfg) -> list[str]:
    out, ckpt = cfg.train.out_dir, ckpt_dir_of(cfg)
    return [out] if _inside(ckpt, out) else [out, ckpt]


# ------------------------------------------------------------------ the holder's start duties
def conflicting_checkpoints(cfg) -> list[str]:
    """Committed checkpoints in ckpt_dir that this run would not continue from: all of them
    for resume=none or a resume from elsewhere, the steps after a resume from within."""
    t, ckpt_dir = cfg.train, ckpt_dir_of(cfg)
    found = files.list_checkpoints(ckpt_dir)
    if t.resume == "auto" or not found:
        return []
    if t.resume == "none":
        return [p for _, p in found]
    path = files.resolve(t.resume)
    if not _inside(path, ckpt_dir):
        return [p for _, p in found]
    try:
        step = files.read_metadata(path)["step"]
    except (CheckpointError, KeyError):
        return []  # resume reports the damage
    return [p for s, p in found if s > step]


def new_aside_dir(parent: str, stamp: str | None = None) -> str:
    """Create and return a fresh `<parent>/overwritten-<time>[-<n>]/` (never an existing one,
    so nothing moved there can replace what an earlier move left)."""
    base = os.path.join(parent, f"overwritten-{stamp or files.timestamp()}")
    for n in range(1000):
        path = base if n == 0 else f"{base}-{n}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}-*: too many directories of that name")


def move_aside(cfg, checkpoints: list[str]) -> str:
    """Move `checkpoints` (and `latest` when it names one) and the old run files into
    <out_dir>/overwritten-<time>/ (<ckpt_dir>/overwritten-<time>/ for a ckpt_dir elsewhere,
    so every move is a rename); returns the directory. Copies metrics.jsonl when the run
    continues from an earlier step, since its records up to there stay in use."""
    t, ckpt_dir = cfg.train, ckpt_dir_of(cfg)
    dest = new_aside_dir(t.out_dir)
    if _inside(ckpt_dir, t.out_dir):
        ckpt_dest = os.path.join(dest, "checkpoints")
        os.makedirs(ckpt_dest)
    else:
        ckpt_dest = new_aside_dir(ckpt_dir, os.path.basename(dest).removeprefix("overwritten-"))
    try:
        latest = files.read_latest(ckpt_dir)
    except CheckpointError:  # damaged: left in place, the next save rewrites it
        latest = None
    moved = {os.path.abspath(p) for p in checkpoints}
    for path in checkpoints:
        os.replace(path, os.path.join(ckpt_dest, os.path.basename(path)))
    if latest is not None and os.path.abspath(latest) in moved:
        os.replace(os.path.join(ckpt_dir, files.LATEST), os.path.join(ckpt_dest, files.LATEST))
    continuing = t.resume != "none" and _inside(files.resolve(t.resume), ckpt_dir)
    for name in RUN_FILES:
        src = os.path.join(t.out_dir, name)
        if os.path.isfile(src):
            (shutil.copy2 if continuing else os.replace)(src, os.path.join(dest, name))
    return dest


def start_duties(cfg) -> list[str]:
    """What the lock holder does before the run writes anything; returns notes to print."""
    notes, t, ckpt_dir = [], cfg.train, ckpt_dir_of(cfg)
    stale = files.stale_temporaries(ckpt_dir)
    atomic_tmp = tuple(f"{name}.tmp." for name in RUN_FILES)  # write_atomic's, e.g. metrics
    stale += sorted(
        os.path.join(t.out_dir, n) for n in os.listdir(t.out_dir) if n.startswith(atomic_tmp)
    )
    for path in stale:
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if stale:
        notes.append(f"removed leftovers of unfinished saves: {', '.join(stale)}")
    conflicts = conflicting_checkpoints(cfg)
    if conflicts and not t.overwrite:
        names = ", ".join(os.path.basename(p) for p in conflicts)
        why = "train.resume=none" if t.resume == "none" else f"train.resume={t.resume}"
        raise RunDirError(
            f"{why}, but {ckpt_dir} holds checkpoints this run would not continue from: "
            f"{names}. Its saves would mix with them (resume=auto and pruning would pick the "
            "wrong ones). Fix: train.resume=auto to continue the newest, another "
            "train.out_dir, or train.overwrite=true to move them (and the old metrics.jsonl) "
            f"aside into {t.out_dir}/overwritten-<time>/ (nothing is deleted)"
        )
    if conflicts:
        dest = move_aside(cfg, conflicts)
        notes.append(f"train.overwrite=true: moved {len(conflicts)} checkpoints aside to {dest}")
    return notes


def claim_run_dir(cfg, rank: int, world: int, group=None, then=None) -> RunLock | None:
    """Take the run directory's lock and do the holder's start duties (collective over
    `group`, default the world), then `then()` on rank 0 (train.main writes the run files):
    returns the lock on rank 0, None elsewhere; raises RunDirError on every rank when rank 0
    was refused or a step failed (a failed write names its file)."""
    lock, verdict = None, ("ok", "")  # rank 0's replaces it (a dry run sends nothing)
    if rank == 0:
        lock = RunLock(lock_directories(cfg))
        try:
            warnings = lock.acquire()
            notes = start_duties(cfg) if lock.owned else []
            if then is not None:
                then()
            verdict = ("ok", "")
        except Exception as e:  # every rank must hear of it, or the others would hang
            lock.release()
            warnings, notes = [], []
            verdict = ("error", str(e) if isinstance(e, RunDirError) else _os_message(cfg, e))
        for w in warnings:
            print(f"[run dir] warning: {w}", file=sys.stderr, flush=True)
        for n in notes:
            print(f"[run dir] {n}", flush=True)
    if world > 1:
        box = [verdict]
        guarded(
            "run directory lock broadcast",
            group,
            lambda: mappings.broadcast_objects(box, 0, group),
        )
        verdict = box[0]
    if verdict[0] != "ok":
        raise RunDirError(verdict[1])
    return lock


def _os_message(cfg, e: OSError) -> str:
    fix = "make it (and train.ckpt_dir) a writable directory"
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space on that disk (or raise the quota), or use another train.out_dir"
    return (
        f"cannot prepare the run directory train.out_dir={cfg.train.out_dir}: "
        f"{type(e).__name__}: {e}. Fix: {fix}"
    )
