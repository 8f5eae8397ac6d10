"""Cross-rank agreement on checkpoint errors, over the checkpoint control group (directory.py).

A checkpoint step that fails on one rank (a file it cannot read, a write that hits EIO, a
crafted `.metadata`) must fail on every rank, with the same error class and message: otherwise
the ranks that succeeded wait in the next collective for the one that gave up, and the run
hangs instead of stopping with a message. `RankAgreement` runs a step on rank 0 or on every
rank, catches its error, shares it over the control group and raises the agreed verdict
everywhere (unsafe file > write error > read error > damage; see `_raise_agreed`).

Every collective goes through `megatron_lite.parallel.mappings.guarded`, so a peer that never
arrives is reported by the hang dump rather than waited on forever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lite.checkpoint.errors import (
    CheckpointError,
    CheckpointReadError,
    CheckpointWriteError,
    UnsafeCheckpointError,
)
from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.mappings import guarded

__all__ = ["RankAgreement", "describe_error"]


def describe_error(e: BaseException, rank: int) -> str:
    """One line for an error: DCP's CheckpointException lists each failing rank's error
    (without the tracebacks it carries)."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in e.failures.items())
    if isinstance(e, CheckpointError):
        return str(e)
    return f"rank {rank}: {type(e).__name__}: {e}"


def _error_entry(e: Exception, where: str, io: str = "read") -> tuple[str, str]:
    """(kind, message) of an error to share with the other ranks; `io` says whether the
    operation read ("read") or wrote ("write") checkpoint files."""
    if isinstance(e, CheckpointWriteError):
        return "write", str(e)
    if isinstance(e, UnsafeCheckpointError):
        return "unsafe", str(e)
    if isinstance(e, CheckpointError) and io == "read":
        return "damaged", str(e)
    return io, f"{where}: {type(e).__name__}: {e}"


_KINDS = {
    "unsafe": UnsafeCheckpointError,
    "write": CheckpointWriteError,
    "read": CheckpointReadError,
    "damaged": CheckpointError,
}


def _raise_agreed(errors: list[tuple[str, str]]) -> None:
    """Raise the gathered errors' verdict the same way on every rank: an unsafe file or a
    write error first, then CheckpointReadError when any rank could not read (never mistaken
    for damage: resume=auto must not skip a good checkpoint over an I/O hiccup), else
    CheckpointError for the first damage found."""
    if not errors:
        return
    order = list(_KINDS)
    kind, message = min(errors, key=lambda e: order.index(e[0]) if e[0] in order else 9)
    raise _KINDS.get(kind, CheckpointError)(message)


class RankAgreement:
    """Control-group collectives of one run's checkpoints (`group`: a gloo group of all `world`
    ranks); every method is collective and is called on every rank in the same order."""

    def __init__(self, rank: int, world: int, group) -> None:
        self.rank, self.world, self.group = rank, world, group

    # ------------------------------------------------------------------ collectives
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        if self.world > 1:
            guarded(
                "checkpoint broadcast",
                self.group,
                lambda: mappings.broadcast_objects(box, 0, self.group),
            )
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)])
        guarded(
            "checkpoint all_reduce",
            self.group,
            lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group),
        )
        return bool(host.read(t, [int(flag)])[0])  # a dry run: this rank's flag

    def all_gather(self, obj: Any, what: str) -> list:
        """Every rank's `obj`, in rank order; `what` names the step in a hang dump."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        guarded(
            f"checkpoint {what}",
            self.group,
            lambda: mappings.all_gather_objects(out, obj, self.group),
        )
        return out

    def barrier(self) -> None:
        """Return once every rank has arrived."""
        if self.world > 1:
            guarded("checkpoint barrier", self.group, lambda: dist.barrier(self.group))

    # ------------------------------------------------------------------ agreed errors
    def from_rank0(self, fn: Callable[[], Any], io: str = "read") -> Any:
        """fn() evaluated on rank 0 (directory listings may differ across nodes' caches) and
        broadcast; an error there is raised on every rank (see _raise_agreed)."""
        result = None
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except Exception as e:  # every rank must hear of it, or the others would hang
                result = _error_entry(e, "rank 0", io)
        status, value = self.broadcast(result)
        if status != "ok":
            _raise_agreed([(status, value)])
        return value

    def on_every_rank(
        self, fn: Callable[[], Any], what: str, gather: bool = False, io: str = "read"
    ) -> Any:
        """fn() on every rank; a failure on any rank is raised on all of them. Returns this
        rank's result, or with `gather` every rank's results in rank order."""
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # every rank must reach the gather below
            error = _error_entry(e, f"{what} on rank {self.rank}", io)
        entries = self.all_gather((error, result if gather else None), what)
        _raise_agreed([e for e, _ in entries if e])
        return [r for _, r in entries] if gather else result

    def agree(self, error: BaseException | None) -> None:
        """Raise CheckpointWriteError on every rank when the save failed on any, with the
        failing ranks' errors."""
        if not self.any(error is not None):
            return
        mine = None if error is None else describe_error(error, self.rank)
        raise CheckpointWriteError("; ".join(m for m in self.all_gather(mine, "save") if m))
