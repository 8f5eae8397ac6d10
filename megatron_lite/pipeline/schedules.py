"""Pipeline schedules as data: one rank's ordered list of actions.

Each function here is pure (no torch.distributed): it returns what one pipeline rank does, in
order. The engine executes the list; `simulate.py` checks a whole table (every rank's list) for
matched sends/receives and deadlock-freedom and measures its bubble, without processes.

Model layout: the model is cut into `pp * vpp` virtual stages; rank `r` holds the local chunks
`c = 0..vpp-1`, which are the virtual stages `c * pp + r`. Activations flow from virtual stage
`s` to `s + 1` (rank r -> r + 1, wrapping from rank pp - 1 to the next chunk on rank 0) and
gradients flow back from `s + 1` to `s`.

An `Action(kind, microbatch, chunk)` is one of
  forward / backward           run that chunk on that microbatch
  recv_forward / send_forward  receive the chunk's input activation / send its output activation
  recv_backward / send_backward receive the grad of the chunk's output / send the grad of its input
Send/recv actions name the local (microbatch, chunk) whose tensor they carry; `peer_of` gives
the other side. There is no recv_forward/send_backward on virtual stage 0 and no
send_forward/recv_backward on the last virtual stage.

Communication is batched: consecutive send/recv actions with no compute between them form one
batch, issued together as one `batch_isend_irecv` that blocks until all its ops complete
(`comm_batches` groups them). Within a batch, activation ops come before gradient ops, so two
ranks that exchange both over one link (pp=2, interleaved) issue them in the same order: issue a
batch's ops in list order. The simulator proves each table deadlock-free under rendezvous
semantics (a send completes only once the peer has posted the matching receive).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

COMPUTE_KINDS = ("forward", "backward")
COMM_KINDS = ("recv_forward", "send_forward", "recv_backward", "send_backward")
KINDS = COMPUTE_KINDS + COMM_KINDS
# Order of ops inside one batch: activation traffic first, then gradient traffic.
_BATCH_ORDER = {"send_forward": 0, "recv_forward": 1, "send_backward": 2, "recv_backward": 3}
_SHORT = {"forward": "F", "backward": "B", "recv_forward": "rF", "send_forward": "sF",
          "recv_backward": "rB", "send_backward": "sB"}  # fmt: skip


@dataclass(frozen=True)
class Action:
    """One step of a rank: `kind` on local model `chunk` for `microbatch`."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("send_")

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{self.microbatch}.{self.chunk}"


Step = Action | tuple[Action, ...]


def virtual_stage(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Global position of local `chunk` on `pp_rank` in the pipeline of pp_size * vpp stages."""
    return chunk * pp_size + pp_rank


def peer_of(action: Action, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """(peer rank, peer's local chunk) on the other side of a send/recv action."""
    if not action.is_comm:
        raise ValueError(f"{action.kind} has no peer: only send/recv actions do")
    downstream = action.kind in ("send_forward", "recv_backward")
    stage = virtual_stage(pp_rank, action.chunk, pp_size) + (1 if downstream else -1)
    return stage % pp_size, stage // pp_size


def comm_batches(actions: list[Action]) -> list[Step]:
    """Group consecutive send/recv actions into one tuple (one batch_isend_irecv each).

    Compute actions stay bare. Example: [F0.0, sF0.0, rB0.0, B0.0] -> [F0.0, (sF0.0, rB0.0), B0.0].
    """
    steps: list[Step] = []
    batch: list[Action] = []
    for action in actions:
        if action.is_comm:
            batch.append(action)
            continue
        if batch:
            steps.append(tuple(batch))
            batch = []
        steps.append(action)
    if batch:
        steps.append(tuple(batch))
    return steps


def format_actions(actions: list[Action]) -> str:
    """Compact one-line form, batches in brackets: 'F0.0 [sF0.0 rB0.0] B0.0'."""
    parts = []
    for step in comm_batches(actions):
        parts.append(f"[{' '.join(map(str, step))}]" if isinstance(step, tuple) else str(step))
    return " ".join(parts)


def check_schedule_args(pp_size: int, num_microbatches: int, vpp: int = 1) -> None:
    """Reject degree/microbatch combinations no schedule supports, with the rule and a fix."""
    if pp_size < 1 or vpp < 1:
        raise ValueError(f"pp={pp_size} and vpp={vpp} must both be >= 1")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    if pp_size == 1:
        if vpp > 1:
            raise ValueError(
                f"vpp={vpp} needs pp >= 2: interleaving splits the model over pipeline ranks; "
                "with pp=1 use vpp=1"
            )
        return
    problem = microbatches_problem(pp_size, num_microbatches, vpp)
    if problem is None:
        return
    if num_microbatches < pp_size:
        raise ValueError(
            f"{problem}; use num_microbatches >= {pp_size} "
            f"(the bubble is (pp-1)/num_microbatches, so more is better)"
        )
    lower = num_microbatches // pp_size * pp_size
    raise ValueError(f"{problem}; use num_microbatches={lower} or {lower + pp_size}, or vpp=1")


def microbatches_problem(pp_size: int, num_microbatches: int, vpp: int = 1) -> str | None:
    """Why the pipeline schedules cannot run `num_microbatches` on (pp, vpp), or None: the one
    owner of the microbatch-count rules (config validation words its message from this)."""
    if pp_size > 1 and num_microbatches < pp_size:
        return (
            f"num_microbatches={num_microbatches} must be >= pp={pp_size} for the 1F1B "
            f"schedule: with fewer than the {pp_size} pipeline stages the pipeline never fills"
        )
    if pp_size > 1 and vpp > 1 and num_microbatches % pp_size:
        return (
            f"num_microbatches={num_microbatches} must be a multiple of pp={pp_size} for the "
            f"interleaved schedule (vpp={vpp}): microbatches pass through the model chunks in "
            "groups of pp"
        )
    return None


def _check_rank(pp_size: int, pp_rank: int) -> None:
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp={pp_size})")


def _batch(*ops: Action | None) -> list[Action]:
    """The non-None ops in the order two ranks sharing a link both use (activations first)."""
    return sorted((op for op in ops if op is not None), key=lambda op: _BATCH_ORDER[op.kind])


def no_pipelining(num_microbatches: int) -> list[Action]:
    """pp=1: forward then backward of each microbatch in turn (gradient accumulation)."""
    check_schedule_args(1, num_microbatches)
    actions = []
    for mb in range(num_microbatches):
        actions += [Action("forward", mb), Action("backward", mb)]
    return actions


def one_f_one_b(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """Non-interleaved 1F1B (PipeDream-flush) as in Megatron / picotron.

    Warm-up: pp - rank - 1 forwards. Steady: one forward, one backward. Cool-down: the
    remaining backwards. At most pp - rank microbatches are in flight on this rank.
    """
    check_schedule_args(pp_size, num_microbatches)
    _check_rank(pp_size, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    m = num_microbatches

    def recv_f(mb):
        return None if first else Action("recv_forward", mb)

    def send_f(mb):
        return None if last else Action("send_forward", mb)

    def recv_b(mb):
        return None if last else Action("recv_backward", mb)

    def send_b(mb):
        return None if first else Action("send_backward", mb)

    num_warmup = min(pp_size - pp_rank - 1, m)
    num_steady = m - num_warmup
    actions: list[Action] = []
    for mb in range(num_warmup):
        actions += _batch(recv_f(mb)) + [Action("forward", mb)] + _batch(send_f(mb))

    if num_steady > 0:
        actions += _batch(recv_f(num_warmup))
    for i in range(num_steady):
        fwd_mb, bwd_mb = num_warmup + i, i
        actions.append(Action("forward", fwd_mb))
        actions += _batch(send_f(fwd_mb), recv_b(bwd_mb))
        actions.append(Action("backward", bwd_mb))
        next_f = recv_f(fwd_mb + 1) if i < num_steady - 1 else None
        actions += _batch(send_b(bwd_mb), next_f)

    for mb in range(num_steady, m):
        actions += _batch(recv_b(mb)) + [Action("backward", mb)] + _batch(send_b(mb))
    return actions


def interleaved_one_f_one_b(
    pp_size: int, pp_rank: int, num_microbatches: int, vpp: int
) -> list[Action]:
    """Megatron's interleaved 1F1B over `vpp` model chunks per rank.

    Microbatches go through the chunks in groups of pp: the k-th forward on a rank is chunk
    (k mod pp*vpp) // pp of microbatch (k // (pp*vpp)) * pp + k mod pp; backwards take the chunks
    in reverse. Warm-up: (pp - rank - 1) * 2 + (vpp - 1) * pp forwards (all of them when
    num_microbatches == pp). Steady: forward, backward, then one batch that sends both results
    and receives the inputs of the next ones. Cool-down: the remaining backwards.
    """
    if vpp < 2:
        raise ValueError(f"vpp={vpp}: the interleaved schedule needs vpp >= 2; use one_f_one_b")
    check_schedule_args(pp_size, num_microbatches, vpp)
    _check_rank(pp_size, pp_rank)
    p, r, total = pp_size, pp_rank, num_microbatches * vpp
    first_rank, last_rank = r == 0, r == p - 1

    def chunk_of(k: int, forward: bool) -> int:
        chunk = (k % (p * vpp)) // p
        return chunk if forward else vpp - 1 - chunk

    def microbatch_of(k: int) -> int:
        return (k // (p * vpp)) * p + k % p

    def stage(chunk: int) -> int:
        return virtual_stage(r, chunk, p)

    def send_f(k: int) -> Action | None:
        chunk = chunk_of(k, True)
        return (
            None if stage(chunk) == p * vpp - 1 else Action("send_forward", microbatch_of(k), chunk)
        )

    def send_b(k: int) -> Action | None:
        chunk = chunk_of(k, False)
        return None if stage(chunk) == 0 else Action("send_backward", microbatch_of(k), chunk)

    # Receives are labelled by chunk here and get their microbatch in `_label_receives`.
    def recv_f(chunk: int) -> Action:
        return Action("recv_forward", -1, chunk)

    def recv_b(chunk: int) -> Action:
        return Action("recv_backward", -1, chunk)

    all_warmup = num_microbatches == p
    num_warmup = total if all_warmup else min((p - r - 1) * 2 + (vpp - 1) * p, total)
    num_steady = total - num_warmup
    actions: list[Action] = [] if first_rank else [recv_f(0)]

    for k in range(num_warmup):
        actions.append(Action("forward", microbatch_of(k), chunk_of(k, True)))
        next_chunk = chunk_of(k + 1, True)
        get_next = k < total - 1 and not (first_rank and next_chunk == 0)
        # The last warm-up batch also fetches the grad for the first backward.
        get_grad = k == num_warmup - 1 and not all_warmup and not last_rank
        actions += _batch(
            send_f(k),
            recv_f(next_chunk) if get_next else None,
            recv_b(vpp - 1) if get_grad else None,
        )

    for i in range(num_steady):
        fk, bk = num_warmup + i, i
        actions.append(Action("forward", microbatch_of(fk), chunk_of(fk, True)))
        actions.append(Action("backward", microbatch_of(bk), chunk_of(bk, False)))
        # Rank 0 receives what the last rank, pp - 1 forwards behind, just produced.
        if first_rank:
            prev_chunk = chunk_of(fk - (p - 1), True)
            next_f = None if prev_chunk == vpp - 1 else recv_f(prev_chunk + 1)
        else:
            next_f = recv_f(chunk_of(fk + 1, True))
        # The last rank receives what rank 0, pp - 1 backwards behind, just produced.
        if last_rank:
            prev_chunk = chunk_of(bk - (p - 1), False)
            next_b = None if prev_chunk == 0 else recv_b(prev_chunk - 1)
        else:
            next_b = recv_b(chunk_of(bk + 1, False))
        if i == num_steady - 1:
            next_f = None
        actions += _batch(send_f(fk), send_b(bk), next_f, next_b)

    if all_warmup and not last_rank:
        actions.append(recv_b(vpp - 1))
    for k in range(num_steady, total):
        actions.append(Action("backward", microbatch_of(k), chunk_of(k, False)))
        next_chunk = chunk_of(k + 1, False)
        get_next = k < total - 1 and not (last_rank and next_chunk == vpp - 1)
        actions += _batch(send_b(k), recv_b(next_chunk) if get_next else None)
    return _label_receives(actions)


def _label_receives(actions: list[Action]) -> list[Action]:
    """Give each receive the microbatch of the next compute on its chunk still lacking input.

    Inputs of one chunk arrive in the order that chunk computes, so the n-th recv_forward for
    chunk c carries the input of the n-th forward of chunk c (likewise for backward).
    """
    order: dict[tuple[str, int], list[int]] = defaultdict(list)
    for a in actions:
        if not a.is_comm:
            order[(a.kind, a.chunk)].append(a.microbatch)
    taken: dict[tuple[str, int], int] = defaultdict(int)
    labelled = []
    for a in actions:
        if a.kind in ("recv_forward", "recv_backward"):
            key = (a.kind.removeprefix("recv_"), a.chunk)
            a = Action(a.kind, order[key][taken[key]], a.chunk)
            taken[key] += 1
        labelled.append(a)
    return labelled


def get_schedule(pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1) -> list[Action]:
    """The action list of `pp_rank`: no pipelining, 1F1B or interleaved 1F1B by (pp, vpp)."""
    check_schedule_args(pp_size, num_microbatches, vpp)
    if pp_size == 1:
        return no_pipelining(num_microbatches)
    if vpp == 1:
        return one_f_one_b(pp_size, pp_rank, num_microbatches)
    return interleaved_one_f_one_b(pp_size, pp_rank, num_microbatches, vpp)


def forward_only(pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1) -> list[Action]:
    """Evaluation: each microbatch through this rank's chunks in virtual-stage order, forwards
    only (receive, forward, send), with no activation kept for a backward."""
    check_schedule_args(pp_size, num_microbatches, vpp)
    _check_rank(pp_size, pp_rank)
    last, actions = pp_size * vpp - 1, []
    for mb in range(num_microbatches):
        for chunk in range(vpp):
            stage = virtual_stage(pp_rank, chunk, pp_size)
            if stage > 0:
                actions.append(Action("recv_forward", mb, chunk))
            actions.append(Action("forward", mb, chunk))
            if stage < last:
                actions.append(Action("send_forward", mb, chunk))
    return actions


def get_schedule_table(pp_size: int, num_microbatches: int, vpp: int = 1) -> list[list[Action]]:
    """Every rank's action list, indexed by pipeline rank (what `simulate` takes)."""
    return [get_schedule(pp_size, r, num_microbatches, vpp) for r in range(pp_size)]
