"""Run torchrun under a supervisor that turns a stop signal into a clean stop.

    python -m megatron_lite.supervise torchrun --nproc-per-node 8 -m megatron_lite.train ...

torchrun answers SIGTERM/SIGINT by raising inside its agent: it forwards SIGTERM to the ranks,
but then exits 1 with a traceback even when every rank saved its checkpoint and exited 0. So the
supervisor starts torchrun in its own session with SIGTERM, SIGINT and SIGUSR1 ignored (torchrun
is told to handle only SIGHUP/SIGQUIT); on the first SIGTERM, SIGINT or SIGUSR1 it sends that
signal to the ranks themselves (torchrun's children), so they log the signal the job got (a
Slurm preemption warning is SIGUSR1). The ranks checkpoint at the step boundary and
exit 0, torchrun sees a successful group and exits 0, and so does the supervisor: a clean stop,
no traceback. A second signal stops hard (SIGKILL to the ranks and torchrun). Used by
`python -m megatron_lite.launch` and launch/slurm/train.sbatch. Ranks restore the default
dispositions at start (megatron_lite.train), so only their own handlers decide.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _ignore_stop_signals() -> None:  # runs in the child between fork and exec
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:  # Linux: if the supervisor dies (SIGKILL), torchrun gets SIGHUP and ends its ranks
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGHUP))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run(cmd: list[str], env: dict | None = None) -> int:
    """Run `cmd` (a torchrun command) to the end; returns its exit code (see module doc)."""
    env = dict(os.environ if env is None else env, TORCHELASTIC_SIGNALS_TO_HANDLE="SIGHUP,SIGQUIT")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_ignore_stop_signals)
    received: list[str] = []

    def on_signal(signum, frame) -> None:
        received.append(signal.Signals(signum).name)
        ranks = children(proc.pid)
        if len(received) == 1:
            print(
                f"[launch] got {received[0]}: asking the {len(ranks)} ranks to checkpoint and "
                "stop at the end of this step (signal again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            _send(ranks, signum)  # the ranks handle all three alike (training/signals.py)
        else:
            _send([*ranks, proc.pid], signal.SIGKILL)

    old = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if received and rc == 0:
        print(f"[launch] stopped cleanly after {received[0]} (exit 0)", file=sys.stderr)
    return rc if rc >= 0 else 128 - rc  # killed by signal N: the shell's 128 + N


USAGE = "usage: python -m megatron_lite.supervise torchrun [torchrun args ...]"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    if argv[0] in ("-h", "--help"):  # only as the first word: the rest belongs to the command
        print(f"{USAGE}\n\n{__doc__.strip()}")
        sys.exit(0)
    if shutil.which(argv[0]) is None:  # Popen would raise FileNotFoundError with a traceback
        message = f"error: command {argv[0]!r} not found. Fix: give torchrun and its arguments"
        print(f"{message}; {USAGE}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
