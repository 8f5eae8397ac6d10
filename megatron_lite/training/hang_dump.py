"""What every rank was doing when a collective timed out: `<out_dir>/hang/rank<R>.json`.

A hang in a parallel job is a mismatch: some rank is in a different collective (or none) than
its peers. Collectives and P2P ops have a deadline (`parallel.timeout_s`); when one passes,
`mappings.CollectiveError` (or its P2P subclass) names rank, step, op and group. `train.py`
then calls `exit_on_collective_error`, which on each rank

1. writes `hang/rank<R>.json`: the error, the step, and the rank's most recent collective and
   P2P operations (from `comm_stats.STATS.recent`: step, kind, group, shape, dtype), oldest
   first, so the last entry is the op the rank was blocked in;
2. after a timeout, waits (at most `min(timeout_s, 60)` s) until every rank of this attempt
   has written its file: ranks stuck together time out within about one step of each other,
   and waiting keeps the first one from exiting (torchrun then SIGTERMs the rest) before a
   slower one has written its file. SIGTERM ends the wait. After a connection error (a peer
   died) there is nothing to wait for: the live peers see the same error at once;
3. prints one line (rank 0: where the files are and which ranks wrote none; a rank with no file
   never reached a timeout, so it is the first suspect) and exits with code 1.

Comparing the files' last entries shows who waited in which op: ranks whose `last_op` differs
from the majority's are the ones out of step.

On GPUs an NCCL collective returns before it runs, so a stuck one is caught by torch's NCCL
watchdog, which ends the process itself (TORCH_NCCL_ASYNC_ERROR_HANDLING) before Python sees an
error: there torch's flight recorder is the per-rank record (launch/slurm/train.sbatch turns on
its dump). Pipeline P2P waits (pipeline/p2p.py) block with a deadline, so they reach this module
on any backend.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from megatron_lite.atomic import write_atomic
from megatron_lite.parallel.comm_stats import STATS, CommStats

HANG_DIR = "hang"
_P2P_KINDS = ("p2p_send", "p2p_recv")


def attempt_id() -> str:
    """Identifies one launch of the job, so files left by an earlier attempt are not counted."""
    keys = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID")
    keys += ("TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")
    return "/".join(os.environ.get(k, "-") for k in keys)


def hang_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, HANG_DIR, f"rank{rank}.json")


def _op(entry: tuple) -> dict:
    step, kind, group, shape, dtype = entry
    return {"step": step, "kind": kind, "group": group, "shape": list(shape), "dtype": dtype}


def write_dump(
    error: BaseException, out_dir: str, rank: int, world_size: int, stats: CommStats = STATS
) -> str:
    """Write this rank's `hang/rank<R>.json` (atomically); returns its path."""
    recent = [_op(e) for e in stats.recent]
    p2p = [op for op in recent if op["kind"] in _P2P_KINDS]
    collectives = [op for op in recent if op["kind"] not in _P2P_KINDS]
    record = {
        "rank": rank,
        "world_size": world_size,
        "step": stats.step,
        "error": str(error),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "attempt": attempt_id(),
        "last_op": recent[-1] if recent else None,
        "last_collective": collectives[-1] if collectives else None,
        "last_p2p": p2p[-1] if p2p else None,
        "recent_ops": recent,  # oldest first, collectives and P2P interleaved as issued
    }
    path = hang_path(out_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1))
    marks = _marker_dir(out_dir)  # written after the file: its rank name says "done"
    os.makedirs(marks, exist_ok=True)
    with open(os.path.join(marks, str(rank)), "w"):
        pass
    return path


def _marker_dir(out_dir: str) -> str:
    """One directory per attempt; a rank's empty file in it marks its dump as written, so
    waiting peers list one directory instead of opening every rank's file."""
    tag = "".join(c if c.isalnum() else "_" for c in attempt_id())
    return os.path.join(out_dir, HANG_DIR, f".written-{tag}")


def ranks_reported(out_dir: str, world_size: int) -> list[int]:
    """Ranks whose hang file belongs to this attempt (one directory listing)."""
    try:
        names = os.listdir(_marker_dir(out_dir))
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and int(n) < world_size)


def wait_for_peers(out_dir: str, world_size: int, grace_s: float, poll_s: float = 0.2):
    """Wait up to `grace_s` for all ranks' files; returns the ranks that wrote one."""
    deadline = time.monotonic() + grace_s
    found = ranks_reported(out_dir, world_size)
    while len(found) < world_size and time.monotonic() < deadline:
        time.sleep(poll_s)
        found = ranks_reported(out_dir, world_size)
    return found


def summary(
    error: BaseException, out_dir: str, rank: int, world_size: int, reported: list[int]
) -> str:
    """The one-line message: rank 0 names the directory and, after a timeout, the ranks
    without a file (the suspects); other ranks name their own file."""
    if rank != 0:
        return f"[hang] {error} (this rank's last ops: {hang_path(out_dir, rank)})"
    files = f"{os.path.join(out_dir, HANG_DIR)}/rank<R>.json"
    missing = ", ".join(str(r) for r in range(world_size) if r not in reported)
    if not is_timeout(error):
        return (
            f"error: {error}. A peer probably exited or crashed: look for the first failure in "
            f"the logs. The ranks' last collective and P2P operations are in {files} "
            f"({len(reported)} of {world_size} written so far)."
        )
    status = f"{len(reported)} of {world_size} ranks wrote one"
    if missing:
        status += (
            f"; no file from rank(s) {missing}: they never reached a collective timeout (stuck "
            "in compute, dead, or in an op without a deadline), so look at them first"
        )
    return (
        f"error: {error}. The last collective and P2P operations of every rank are in {files} "
        f"({status}); compare their last_op entries to find the rank that is out of step."
    )


def is_timeout(error: BaseException) -> bool:
    """gloo: "Timed out waiting ...", NCCL watchdog: "... timeout ...", p2p: "timed out after"."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def exit_on_collective_error(
    error: BaseException, out_dir: str, rank: int, world_size: int, timeout_s: float
) -> None:
    """Dump, wait for the other ranks' dumps, print one line, exit 1 (see the module doc)."""
    try:
        write_dump(error, out_dir, rank, world_size)
    except OSError as e:  # a full disk: the message still goes out, and says so
        print(f"[hang] rank {rank}: could not write its hang dump: {e}", file=sys.stderr)
    # the file is written: from here on torchrun's SIGTERM (a peer exited) may end us at once
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    grace_s = min(timeout_s, 60.0) if is_timeout(error) else 0.0
    reported = wait_for_peers(out_dir, world_size, grace_s)
    print(summary(error, out_dir, rank, world_size, reported), file=sys.stderr, flush=True)
    sys.stdout.flush()
    # no process-group teardown: a collective may still be stuck in it
    os._exit(1)
