"""torchrun whose exit code is the ranks' own, without torchrun's failure report.

    python -m megatron_lite.torchrun [torchrun args ...] -m megatron_lite.train ...

torchrun exits 1 whenever a rank fails, whatever the rank's code, after a `ChildFailedError`
traceback and report. The ranks' codes mean something here (docs/clusters.md, "Exit codes": 2 a
user error, 3 a non-finite step), so this runs torchrun's own agent (`torch.distributed.run`,
the module behind the `torchrun` command) in this process and exits with the code `exit_code`
picks: the first rank to fail decides (what torchrun's report calls the root cause; the ranks
that fail after it, and those torchrun stops with SIGTERM, follow from it):

- it exited by itself with code C: C. The rank printed its message; nothing is added, so a
  user error stays one paragraph;
- it was killed by signal N: 128 + N (the shell's convention), with a line naming the rank;
- several ranks failed first (torchrun times failures to the second): a rank killed by a
  signal other than SIGTERM (a crash: the OOM killer's SIGKILL, SIGSEGV, ...) decides; else
  their own codes: one code is the launcher's, different codes make it 1 (ranks that agree
  on a stop exit with one code, so a mix is a crash) with a line listing each rank's; else
  (SIGTERM only) 143.

Used by `python -m megatron_lite.launch` and launch/slurm/train.sbatch, under
megatron_lite/supervise.py.

The ranks' side (the store each rank's process group starts from) is megatron_lite/rendezvous.py.
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
    listed = ", ".join(
        f"rank {r}: " + (f"exit code {c}" if c > 0 else f"killed by {_signal_name(-c)}")
        for r, (c, _) in sorted(failures.items())
    )
    t0 = min(t for _, t in failures.values())
    first = {rank: code for rank, (code, t) in sorted(failures.items()) if t == t0}
    crashed = [r for r, c in first.items() if c < 0 and -c != signal.SIGTERM]
    own = {c for c in first.values() if c > 0}
    if not crashed and len(own) == 1:
        return own.pop(), None
    if not crashed and own:
        return 1, f"[launch] the ranks failed with different exit codes ({listed}): exit 1"
    rank = crashed[0] if crashed else next(iter(first))  # else: SIGTERM only
    code = 128 - first[rank]
    name = _signal_name(-first[rank])
    return code, f"[launch] rank {rank} was killed by {name} ({listed}): exit {code}"


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import get_args_parser, run

    # torchrun's parser, without prefix matching: the script's own flags (generate's --run)
    # are not taken for abbreviations of torchrun's (--run-path)
    parser = get_args_parser()
    parser.allow_abbrev = False
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)  # exits 2 on a bad one
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropAgentNoise())
    try:
        run(args)
    except ChildFailedError as e:
        failures = {rank: (f.exitcode, f.timestamp) for rank, f in e.failures.items()}
        code, line = exit_code(failures)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        sys.exit(code)
    except RendezvousTimeoutError:  # the other nodes never came
        print(join_timeout_message(args), file=sys.stderr, flush=True)
        sys.exit(1)
    except RendezvousError as e:  # another node's agent, which hosts the store, ended first
        cause = e.__cause__ or e
        print(
            f"[launch] this node lost the rendezvous with the other nodes ({type(e).__name__}: "
            f"{cause}): a node that ended first decides the job's exit code (srun reports the "
            "largest); this node exits 1",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


def join_timeout_message(args) -> str:
    """The line for an agent whose rendezvous timed out: what it waited for, where, the fix."""
    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    waited = conf.get("join_timeout", "600")  # torch's default
    return (
        f"[launch] this node waited {waited} s (--rdzv-conf join_timeout) at the rendezvous "
        f"{args.rdzv_endpoint} (--rdzv-endpoint, id {args.rdzv_id}) for --nnodes={args.nnodes}, "
        "and the other nodes did not all join: this node exits 1. Fix: start torchrun on "
        "every node with the same --rdzv-endpoint, --rdzv-id and --nnodes (under Slurm, see "
        "the other nodes' logs: a node that failed to start ends the job), or raise "
        "join_timeout when nodes start far apart"
    )


if __name__ == "__main__":
    main()
