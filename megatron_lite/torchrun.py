"""torchrun whose exit code is the ranks' own, without torchrun's failure report.

    python -m megatron_lite.torchrun [torchrun args ...] -m megatron_lite.train ...

torchrun exits 1 whenever a rank fails, whatever the rank's code, after a `ChildFailedError`
traceback and report. The ranks' codes mean something here (README, "exit codes": 2 a user
error, 3 a non-finite step), so this runs torchrun's own agent (`torch.distributed.run`, the
module behind the `torchrun` command) in this process and exits with the code `exit_code`
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

The ranks' side of torchrun lives here too: `group_store`, the store each rank's process group
starts from (see its doc: a port that cannot be lost, and keys no earlier attempt wrote).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time
import uuid

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
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)  # exits 2 on a bad argument
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


# ---------------------------------------------------------------- the ranks' side
_RDZV = "megatron_lite/rdzv"  # the handshake's keys in the agent's store
_POLL_S = 0.01


class StartupError(RuntimeError):
    """A rank could not join its process group; the message names the rank, what it waited for
    or what failed, and the fix."""


def group_store(rank: int, world: int, timeout: datetime.timedelta):
    """The store this rank's process group starts from, or None for torch's env:// (no shared
    agent store: plain `python -m`, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).

    torchrun (torch >= 2.5) hosts one TCPStore in its agent for the whole job and hands its
    port to the ranks as MASTER_PORT: the agent bound it (port 0, so the OS picked a free one)
    before the ranks were started and holds it until it exits, so no other process can take
    it, and no rank binds a port at all. The same store serves every restart, with the keys of
    earlier attempts still in it (pytorch/pytorch#135712: a restarted rank read a dead peer's
    address). So every attempt works under a key prefix no earlier attempt used, agreed by a
    handshake in which each waiting rank names the key it waits on:

    - rank 0 draws the prefix P (a random UUID);
    - every other rank draws a random nonce N, appends it to the list `hellos`, and waits for
      the key `welcome/N`; rank 0 writes P into `welcome/N` for every nonce it finds in the list
      (earlier attempts' nonces too: nobody waits on those) until all world-1 ranks have
      confirmed under P, then clears the list.

    Why a rank cannot read an earlier attempt's prefix: `welcome/N` is named by a nonce this
    process just drew, so only a process that read it from this attempt's `hellos` can have
    written it, i.e. a rank 0 alive now; and torchrun starts an attempt's ranks only after it
    has stopped every rank of the one before (on every node: the rendezvous round completes
    only when each agent has stopped its ranks), so the rank 0 alive now is this attempt's.
    TORCHELASTIC_RESTART_COUNT is not used: on several nodes it differs between agents (an
    agent whose ranks were healthy restarts them without counting), which is why torch itself
    dropped a prefix built from it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"torchrun's store at {addr}:{port} (MASTER_ADDR:MASTER_PORT)"
    seconds = f"{timeout.total_seconds():g} s (parallel.timeout_s)"
    try:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as e:  # DistNetworkError, DistStoreError, ...
        raise StartupError(
            f"rank {rank}: could not reach {where} within {seconds}: {_first_line(e)}. Fix: "
            "start the ranks with torchrun (its agent hosts that store) and check that this "
            "node reaches MASTER_ADDR"
        ) from None
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        prefix = _welcome(store, world, deadline, seconds)
    else:
        prefix = _hello(store, rank, where, seconds)
    return dist.PrefixStore(f"{_RDZV}/{prefix}", store)


def _hello(store, rank: int, where: str, seconds: str) -> str:
    """A non-zero rank's half of the handshake: this attempt's prefix, from rank 0."""
    nonce = uuid.uuid4().hex
    store.append(f"{_RDZV}/hellos", f"{nonce};")
    try:
        prefix = store.get(f"{_RDZV}/welcome/{nonce}").decode()
    except RuntimeError as e:  # DistStoreError: the store's timeout
        raise StartupError(
            f"rank {rank}: waited {seconds} for rank 0 through {where}, and it never answered "
            f"({_first_line(e)}): rank 0 did not start, or failed first. Fix: see rank 0's "
            "message above; if rank 0 is slow to start (a loaded machine, a slow shared file "
            "system), raise parallel.timeout_s"
        ) from None
    store.set(f"{_RDZV}/{prefix}/joined/{rank}", "1")
    store.add(f"{_RDZV}/{prefix}/joined", 1)
    return prefix


def _welcome(store, world: int, deadline: float, seconds: str) -> str:
    """Rank 0's half: answer every nonce in `hellos` until world-1 ranks joined; the prefix."""
    prefix, answered = uuid.uuid4().hex, set()
    hellos, joined = f"{_RDZV}/hellos", f"{_RDZV}/{prefix}/joined"
    while store.add(joined, 0) < world - 1:
        if time.monotonic() > deadline:
            missing = [r for r in range(1, world) if not store.check([f"{joined}/{r}"])]
            raise StartupError(
                f"rank 0: waited {seconds} for the other ranks to join, and rank(s) "
                f"{_ranges(missing)} of {world} never did: they did not start, or failed "
                "before joining. Fix: see their messages above; if they are slow to start "
                "(a loaded machine, a slow shared file system), raise parallel.timeout_s"
            )
        store.append(hellos, "")  # the list exists, so get() does not wait
        for nonce in store.get(hellos).decode().split(";"):
            if nonce and nonce not in answered:
                store.set(f"{_RDZV}/welcome/{nonce}", prefix)
                answered.add(nonce)
        time.sleep(_POLL_S)
    # every rank of this attempt has appended its nonce (each did before joining), and the
    # next attempt's ranks start after this one's have stopped: the list holds nothing live
    store.delete_key(hellos)
    return prefix


def _ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


if __name__ == "__main__":
    main()
