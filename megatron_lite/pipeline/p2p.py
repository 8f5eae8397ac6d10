"""Point-to-point traffic between pipeline stages: one schedule batch, one batch_isend_irecv.

`P2PCommunicator.exchange(batch, tensors)` posts every send/recv of one `comm_batches` step
together (`torch.distributed.batch_isend_irecv`, in the batch's order, which both ranks of a
link share) and waits for all of them. Shapes are known from the config, so nothing but the
payload crosses: every tensor is the hidden state of one microbatch, [s/cp, b, h], or
[s/(cp·tp), b, h] under sequence parallelism, and its gradient has the same shape.

Wire dtype (`pipeline_dtype`) is the residual stream's: fp32 under train.precision=fp32, bf16
under bf16 (bf16 parameters: the embedding output that starts the stream is bf16), fp32 again
under bf16 with model.fp32_residual_connection (the embedding output is cast to fp32). The
engine casts each stage output to it before sending, so the receiver never needs the sender's
dtype.

Each op reports to `comm_stats` (kind p2p_send / p2p_recv). Waits have a deadline (the group
timeout, parallel.timeout_s): on timeout or a backend error, `P2PError` names rank, step,
action, microbatch, chunk and peer rank. The wait is the same timed `work.wait(timeout)` on
every backend. On NCCL a plain `wait()` only orders the compute stream after the transfer and
returns, so a stuck send/recv would end only in NCCL's watchdog (train.py configures it and its
flight recorder); the timed wait also blocks the host until the batch has landed (NCCL polls
every millisecond; Megatron synchronizes the device after each batched p2p by default) and on
timeout aborts the communicator and raises here. MEGATRON_LITE_P2P_TRACE=1 prints every op
as it is posted and every batch as it completes, so the last line a stuck rank printed shows
what it waits for.

`warm_up(group, device, timeout_s)` sends one tiny message each way on every link of the
pipeline ring before step 1 (every rank of the group calls it): on NCCL that first p2p call also
builds the group's communicator, so a broken NCCL/P2P setup or a rank that never arrives ends
at start-up with a `P2PError` naming rank and peer, not in the middle of step 1.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_lite.parallel import mappings
from megatron_lite.parallel.comm_stats import STATS
from megatron_lite.parallel.mappings import CollectiveError
from megatron_lite.pipeline.schedules import Action, peer_of

TRACE_ENV = "MEGATRON_LITE_P2P_TRACE"


class P2PError(CollectiveError):
    """A pipeline send/recv failed or timed out; names rank, step, action and peer rank."""


def _wait_all(works, labels, deadline: float, timeout_s: float, error) -> None:
    """Wait for each work in turn until `deadline` (time.monotonic()), a timed wait on every
    backend (module docstring); `error(label, what)` builds the exception naming it."""
    for label, work in zip(labels, works, strict=True):
        remaining = deadline - time.monotonic()
        try:
            ok = remaining > 0 and work.wait(timedelta(seconds=remaining)) is not False
        except RuntimeError as e:  # gloo/NCCL raise on timeout, and on a lost peer
            text = str(e).lower()
            late = "timed out" in text or "timeout" in text or time.monotonic() >= deadline
            what = f"timed out after {timeout_s:g}s" if late else "failed"
            raise error(label, f"{what}: {e}") from e
        if not ok:
            raise error(label, f"timed out after {timeout_s:g}s")


def pipeline_dtype(precision: str, fp32_residual_connection: bool = False) -> torch.dtype:
    """dtype of every tensor crossing stages: the residual stream's (module doc)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"train.precision={precision!r}: expected fp32 or bf16")
    if precision == "bf16" and not fp32_residual_connection:
        return torch.bfloat16
    return torch.float32


def activation_shape(
    seq_length: int, micro_batch_size: int, hidden_size: int, cp: int, tp: int, sp: bool
) -> tuple[int, int, int]:
    """Shape of the hidden state between stages: [s/cp, b, h], or [s/(cp·tp), b, h] with SP."""
    split = cp * (tp if sp and tp > 1 else 1)
    if seq_length % split:
        raise ValueError(f"seq_length={seq_length} is not divisible by cp·tp(sp) = {split}")
    return (seq_length // split, micro_batch_size, hidden_size)


class P2PCommunicator:
    """Sends/receives of one pipeline rank with its neighbours in `ranks` (global ranks of the
    pipeline group in stage order, i.e. `mesh.pp.ranks`).

    `shape`/`dtype`: the one tensor kind that crosses (see `activation_shape`). `timeout_s`
    bounds each batch. `trace` defaults to the MEGATRON_LITE_P2P_TRACE environment variable.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        ranks: Sequence[int],
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        timeout_s: float,
        trace: bool | None = None,
        placement: str = "loop",
    ):
        self.group, self.ranks, self.placement = group, list(ranks), placement
        self.rank = dist.get_rank()
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in the pipeline group {self.ranks}")
        self.pp_rank, self.pp_size = self.ranks.index(self.rank), len(self.ranks)
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.timeout_s = timeout_s
        self.trace = os.environ.get(TRACE_ENV, "0") not in ("", "0") if trace is None else trace

    def peer(self, action: Action) -> int:
        """Global rank on the other side of a send/recv action."""
        return self.ranks[peer_of(action, self.pp_rank, self.pp_size, self.placement)[0]]

    def exchange(
        self, batch: Sequence[Action], tensors: Mapping[Action, torch.Tensor]
    ) -> dict[Action, torch.Tensor]:
        """Post all send/recv ops of `batch` as one batch_isend_irecv and wait for them.

        `tensors` holds the payload of each send action ([s/cp(/tp), b, h]); returns a fresh
        tensor of that shape for each recv action.
        """
        posted = self.post(batch, tensors)
        posted.wait()
        return posted.received

    def post(self, batch: Sequence[Action], tensors: Mapping[Action, torch.Tensor]) -> Posted:
        """Post `batch` as `exchange` does and return at once: `Posted.wait(action)` waits for
        one op (what a compute needs), `Posted.wait()` for all (the zero-bubble schedules)."""
        ops, received = [], {}
        for action in batch:
            if not action.is_comm:
                raise ValueError(f"{action} is not a send/recv action")
            if action.is_send:
                buf = self._check_send(action, tensors.get(action))
                op, kind = dist.isend, "p2p_send"
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[action] = buf
                op, kind = dist.irecv, "p2p_recv"
            STATS.record(kind, buf, "pp", op="send", n=2)  # one message between two stages
            self._trace_op(action)
            ops.append(dist.P2POp(op, buf, self.peer(action), group=self.group))
        deadline = time.monotonic() + self.timeout_s
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._error(batch, batch[0], f"failed to post: {e}") from e
        # gloo returns one work per op; a coalesced backend (NCCL) one for the whole batch
        per_op = len(works) == len(ops)
        return Posted(self, tuple(batch), works, received, deadline, per_op)

    def _check_send(self, action: Action, t: torch.Tensor | None) -> torch.Tensor:
        if t is None:
            raise ValueError(f"rank {self.rank}: no tensor given for {action}")
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(
                f"rank {self.rank} step {STATS.step}: {action.kind} mb {action.microbatch} "
                f"chunk {action.chunk} has {tuple(t.shape)} {t.dtype}, but the receiver expects "
                f"{self.shape} {self.dtype} ([s/cp(/tp), b, h] from the config)"
            )
        return t.detach().contiguous()

    def _describe(self, action: Action) -> str:
        arrow = "->" if action.is_send else "<-"
        return (
            f"{action.kind} mb {action.microbatch} chunk {action.chunk} {arrow} peer "
            f"{self.peer(action)}"
        )

    def _print(self, text: str) -> None:
        print(f"[p2p] rank {self.rank} step {STATS.step} {text}", file=sys.stdout, flush=True)

    def _trace_op(self, action: Action) -> None:
        if self.trace:
            self._print(self._describe(action))

    def _error(self, batch: Sequence[Action], action: Action, what: str) -> P2PError:
        return P2PError(
            f"rank {self.rank} step {STATS.step}: pipeline p2p {self._describe(action)} "
            f"(pp rank {self.pp_rank} of {self.pp_size}, batch [{' '.join(map(str, batch))}]) "
            f"{what}"
        )


class Posted:
    """One posted batch: its received buffers and the works still to wait for."""

    def __init__(self, comm: P2PCommunicator, batch, works, received, deadline, per_op: bool):
        self.comm, self.batch, self.received, self.deadline = comm, batch, received, deadline
        # per op (gloo), or every op waits for the one coalesced work (waiting twice is harmless)
        self.pending = (
            {a: [w] for a, w in zip(batch, works, strict=True)}
            if per_op
            else {a: list(works) for a in batch}
        )

    def wait(self, action: Action | None = None) -> None:
        """Wait for `action`'s op (None: every op of the batch), with the batch's deadline."""
        error = functools.partial(self.comm._error, self.batch)
        for a in self.batch if action is None else (action,):
            works = self.pending.pop(a, [])
            _wait_all(works, [a] * len(works), self.deadline, self.comm.timeout_s, error)
        if action is None and self.comm.trace:
            self.comm._print(f"done [{' '.join(map(str, self.batch))}]")

    def landed(self, action: Action) -> bool:
        """Whether `action`'s op has completed, without waiting (then it needs no wait)."""
        if all(w.is_completed() for w in self.pending.get(action, [])):
            self.wait(action)  # completed: collects errors, returns at once
            return True
        return False


def _post(ops: list, deadline: float, device: torch.device):
    """dist.batch_isend_irecv(ops) on a helper thread, None if it has not returned by the
    deadline: on NCCL the group's first p2p call builds its communicator, which waits for every
    rank of it and has no timeout of its own."""
    out: dict = {}

    def post() -> None:
        try:
            if device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(device)
            out["works"] = dist.batch_isend_irecv(ops)
        except Exception as e:  # re-raised on the calling thread
            out["error"] = e

    thread = threading.Thread(target=post, name="p2p-warm-up", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if "error" in out:
        raise out["error"]
    return out.get("works")


_WHAT = {"pp": "pipeline", "cp": "context-parallel ring"}


def warm_up(
    group: dist.ProcessGroup, device: torch.device, timeout_s: float, axis: str = "pp"
) -> None:
    """Before step 1, on every rank of the ring `group` (the pipeline's, module docstring; or
    the context-parallel ring's, `axis` "cp", whose attention sends K/V around it): each rank
    sends its global rank to the next and the previous stage and checks what it receives from
    them (the ring's wrap link included: interleaved schedules use it). Raises P2PError naming
    rank and peer when a link fails, a peer does not take part within `timeout_s`, or the ranks
    disagree on the group's order. Nothing to do on a group of one, or in a dry run."""
    if mappings.size(group) == 1 or dist.get_backend(group) == "fake":
        return
    ranks = dist.get_process_group_ranks(group)
    rank = dist.get_rank()
    i, n = ranks.index(rank), len(ranks)
    nxt, prev = ranks[(i + 1) % n], ranks[(i - 1) % n]
    mine = torch.full((1,), rank, dtype=torch.int64, device=device)
    from_prev, from_next = torch.empty_like(mine), torch.empty_like(mine)
    ops = [
        dist.P2POp(dist.isend, mine, nxt, group=group),
        dist.P2POp(dist.irecv, from_prev, prev, group=group),
        dist.P2POp(dist.isend, mine, prev, group=group),
        dist.P2POp(dist.irecv, from_next, nxt, group=group),
    ]
    both = f"send/recv with peers {prev} and {nxt}"
    labels = [f"send -> peer {nxt}", f"recv <- peer {prev}", f"send -> peer {prev}"]
    labels.append(f"recv <- peer {nxt}")
    STATS.note("p2p_warm_up", getattr(group, "group_desc", axis))

    def error(label: str, what: str) -> P2PError:
        return P2PError(
            f"rank {rank} step {STATS.step}: {_WHAT[axis]} warm-up {label} "
            f"({axis} rank {i} of {n}, "
            f"group {mappings.group_name(group)}) {what}. The link between rank {rank} and its "
            "peer does not work: check that the peer rank started and reached the warm-up, "
            "and the NCCL set-up (NCCL_DEBUG=INFO prints the transport each link uses)"
        )

    deadline = time.monotonic() + timeout_s
    try:
        works = _post(ops, deadline, device)
    except RuntimeError as e:
        raise error(both, f"failed to post: {e}") from e
    if works is None:
        raise error(both, f"timed out after {timeout_s:g}s posting (NCCL communicator set-up)")
    # gloo: one work per op; NCCL: one for the batch
    named = labels if len(works) == len(ops) else [both] * len(works)
    _wait_all(works, named, deadline, timeout_s, error)
    have = [int(from_prev.item()), int(from_next.item())]
    if have != [prev, nxt]:
        what = f"got the messages of ranks {have}: the ranks disagree on the group's order"
        raise error(f"recv <- peers {prev} and {nxt}", what)
