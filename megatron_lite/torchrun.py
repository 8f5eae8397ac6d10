"""torchrun whose exit code is the ranks' own, without torchrun's failure report.

    python -m megatron_lite.torchrun [torchrun args ...] -m megatron_lite.train ...

torchrun exits 1 whenever a rank fails, whatever the rank's code, after a `ChildFailedError`
traceback and report. The ranks' codes mean something here (README, "exit codes": 2 a user
error, 3 a non-finite step), so this runs torchrun's own agent (`torch.distributed.run`, the
module behind the `torchrun` command) in this process and exits with the code `exit_code`
picks from the failed ranks:

- the ranks that exited by themselves (a code > 0) all exited with the same code: that code.
  The rank printed its message; nothing is added, so a user error stays one paragraph;
- they exited with different codes: 1 (ranks that agree on a stop exit with one code, so a
  mix is a crash), with one line listing each rank's code;
- every failed rank was killed by a signal: 128 + the signal of the first (the shell's
  convention), preferring a signal other than the SIGTERM torchrun sends the survivors.

Ranks torchrun itself stopped after the first failure (SIGTERM) never decide the code while
another rank exited by itself. Used by `python -m megatron_lite.launch` and
launch/slurm/train.sbatch, under megatron_lite/supervise.py.
"""

from __future__ import annotations

import logging
import signal
import sys

# torchrun's own failure lines, replaced here by the exit code (and a line for a crash)
_AGENT_NOISE = ("failed (exitcode: ", "Sending process ")


class _DropAgentNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_AGENT_NOISE)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(failures: dict[int, tuple[int, float]]) -> tuple[int, str | None]:
    """(the exit code, a line to print or None) for failed ranks {rank: (exitcode, time)};
    exitcode < 0 means killed by that signal (see the module doc for the rule)."""
    own = {rank: code for rank, (code, _) in failures.items() if code > 0}
    if len(set(own.values())) == 1:
        return next(iter(own.values())), None
    listed = ", ".join(
        f"rank {r}: " + (f"exit code {c}" if c > 0 else f"killed by {_signal_name(-c)}")
        for r, (c, _) in sorted(failures.items())
    )
    if own:
        return 1, f"[launch] the ranks failed with different exit codes ({listed}): exit 1"
    # killed by signals only: the first, and not the SIGTERM torchrun sends the others
    first = min(failures.items(), key=lambda kv: (kv[1][1], -kv[1][0] == signal.SIGTERM, kv[0]))
    rank, (code, _) = first
    name = _signal_name(-code)
    return 128 - code, f"[launch] rank {rank} was killed by {name} ({listed}): exit {128 - code}"


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)  # exits 2 on a bad argument
    for name in ("torch.distributed.elastic.multiprocessing.api",):
        logging.getLogger(name).addFilter(_DropAgentNoise())
    try:
        run(args)
    except ChildFailedError as e:
        failures = {rank: (f.exitcode, f.timestamp) for rank, f in e.failures.items()}
        code, line = exit_code(failures)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        sys.exit(code)


if __name__ == "__main__":
    main()
