"""The ranks' side of torchrun: `group_store`, the store each rank's process group starts from
(a port that cannot be lost, and keys no earlier attempt wrote; see its doc). The agent's side
is megatron_lite/torchrun.py."""

from __future__ import annotations

import datetime
import os
import time
import uuid

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
