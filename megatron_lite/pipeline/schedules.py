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

COMPUTE_KINDS = ("forward", "backward", "weight")
COMM_KINDS = ("recv_forward", "send_forward", "recv_backward", "send_backward")
KINDS = COMPUTE_KINDS + COMM_KINDS
# Order of ops inside one batch: activation traffic first, then gradient traffic.
_BATCH_ORDER = {"send_forward": 0, "recv_forward": 1, "send_backward": 2, "recv_backward": 3}
RECV_OF = {"send_forward": "recv_forward", "send_backward": "recv_backward"}  # a send's match
_SHORT = {"forward": "F", "backward": "B", "weight": "W", "recv_forward": "rF",
          "send_forward": "sF", "recv_backward": "rB", "send_backward": "sB"}  # fmt: skip
# Where the pp * vpp virtual stages sit: "loop" puts stage c * pp + r on rank r (Megatron's
# interleaving), "v" puts stages r and 2 * pp - 1 - r on rank r (ZB-V, DualPipeV: vpp = 2, and
# the last rank's two chunks meet, so the turn from chunk 0 to chunk 1 stays on one rank).
PLACEMENTS = ("loop", "v")


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


def virtual_stage(pp_rank: int, chunk: int, pp_size: int, placement: str = "loop") -> int:
    """Global position of local `chunk` on `pp_rank` in the pipeline of pp_size * vpp stages."""
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"chunk={chunk}: the V placement holds chunks 0 and 1 only")
        return pp_rank if chunk == 0 else 2 * pp_size - 1 - pp_rank
    if placement != "loop":
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    return chunk * pp_size + pp_rank


def stage_location(stage: int, pp_size: int, placement: str = "loop") -> tuple[int, int]:
    """(pipeline rank, local chunk) holding virtual `stage`: the inverse of `virtual_stage`."""
    if placement == "v":
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    if placement != "loop":
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    return stage % pp_size, stage // pp_size


def peer_of(action: Action, pp_rank: int, pp_size: int, placement: str = "loop") -> tuple[int, int]:
    """(peer rank, peer's local chunk) on the other side of a send/recv action."""
    if not action.is_comm:
        raise ValueError(f"{action.kind} has no peer: only send/recv actions do")
    downstream = action.kind in ("send_forward", "recv_backward")
    stage = virtual_stage(pp_rank, action.chunk, pp_size, placement) + (1 if downstream else -1)
    return stage_location(stage, pp_size, placement)


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


def check_schedule_args(
    pp_size: int, num_microbatches: int, vpp: int = 1, schedule: str | None = None
) -> None:
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
    problem = microbatches_problem(pp_size, num_microbatches, vpp, schedule)
    if problem is None:
        return
    if schedule == "dualpipev" and num_microbatches < 2 * pp_size:
        raise ValueError(f"{problem}; use num_microbatches >= {2 * pp_size}")
    if num_microbatches < pp_size:
        raise ValueError(
            f"{problem}; use num_microbatches >= {pp_size} "
            f"(the bubble is (pp-1)/num_microbatches, so more is better)"
        )
    lower = num_microbatches // pp_size * pp_size
    raise ValueError(f"{problem}; use num_microbatches={lower} or {lower + pp_size}, or vpp=1")


def microbatches_problem(
    pp_size: int, num_microbatches: int, vpp: int = 1, schedule: str | None = None
) -> str | None:
    """Why the pipeline schedules cannot run `num_microbatches` on (pp, vpp), or None: the one
    owner of the microbatch-count rules (config validation words its message from this)."""
    if pp_size > 1 and num_microbatches < pp_size:
        return (
            f"num_microbatches={num_microbatches} must be >= pp={pp_size} for the 1F1B "
            f"schedule: with fewer than the {pp_size} pipeline stages the pipeline never fills"
        )
    if pp_size > 1 and schedule == "dualpipev" and num_microbatches < 2 * pp_size:
        return (
            f"num_microbatches={num_microbatches} must be >= 2·pp={2 * pp_size} for the "
            "dualpipev schedule: each rank's warm-up forwards 2·(pp - rank) - 1 microbatches "
            "before its first backward"
        )
    if pp_size > 1 and vpp > 1 and schedule in (None, "interleaved") and num_microbatches % pp_size:
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


def with_comm(
    computes: list[Action], pp_size: int, pp_rank: int, vpp: int = 1, placement: str = "loop"
) -> list[Action]:
    """A rank's compute order with its sends and receives put in: the input of each forward
    (grad of each backward) is received right before it and its result sent right after, unless
    the neighbouring stage sits on this rank (the V turn). A receive goes before the weight
    actions that precede its compute, so under posted batches (simulate's comm="posted") W
    runs while the input is in flight."""
    last = pp_size * vpp - 1
    actions: list[Action] = []
    for a in computes:
        stage = virtual_stage(pp_rank, a.chunk, pp_size, placement)
        before = stage > 0 and stage_location(stage - 1, pp_size, placement)[0] != pp_rank
        after = stage < last and stage_location(stage + 1, pp_size, placement)[0] != pp_rank
        if a.kind == "forward":
            pre, post = ("recv_forward" if before else None), ("send_forward" if after else None)
        elif a.kind == "backward":
            pre, post = ("recv_backward" if after else None), ("send_backward" if before else None)
        else:
            pre = post = None
        if pre:  # posted before the weight passes that precede it, which run while it lands
            at = len(actions)
            while at and actions[at - 1].kind == "weight":
                at -= 1
            actions.insert(at, Action(pre, a.microbatch, a.chunk))
        actions.append(a)
        actions += [Action(post, a.microbatch, a.chunk)] if post else []
    return _sorted_batches(actions)


def _sorted_batches(actions: list[Action]) -> list[Action]:
    """Each run of consecutive send/recv actions in `_BATCH_ORDER` (activations first)."""
    out: list[Action] = []
    for step in comm_batches(actions):
        out += _batch(*step) if isinstance(step, tuple) else [step]
    return out


def receive_in_send_order(
    tables: list[list[Action]], placement: str = "loop"
) -> list[list[Action]]:
    """Every rank's table with receives moved up so that, on each link, they come in the order
    the sender sends (p2p on one link is matched first-in first-out, as NCCL does).

    Needed where two kinds of traffic share a link in opposite orders (ZB-V, DualPipeV: link
    r -> r + 1 carries chunk-0 activations and chunk-1 gradients); a receive that moves up is
    only posted earlier, which posted batches (simulate's comm="posted") never wait on."""
    pp = len(tables)
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    for rank, actions in enumerate(tables):
        for a in actions:
            if a.is_send:
                peer, chunk = peer_of(a, rank, pp, placement)
                sent[(rank, peer)].append((RECV_OF[a.kind], a.microbatch, chunk))
    fixed = []
    for rank, actions in enumerate(tables):
        queue = {link: list(order) for link, order in sent.items() if link[1] == rank}
        posted: set[tuple[str, int, int]] = set()
        out: list[Action] = []
        for a in actions:
            if a.is_comm and not a.is_send:
                key = (a.kind, a.microbatch, a.chunk)
                if key not in posted:
                    link = (peer_of(a, rank, pp, placement)[0], rank)
                    order = queue[link]
                    while order:  # everything the sender sends first, then this one
                        kind, mb, chunk = order.pop(0)
                        posted.add((kind, mb, chunk))
                        out.append(Action(kind, mb, chunk))
                        if (kind, mb, chunk) == key:
                            break
                continue
            out.append(a)
        fixed.append(out)
    return fixed


def zb_h1(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024): 1F1B with each backward split into B (input grad) and W (weight
    grad), at 1F1B's activation memory.

    Warm-up and steady phase are 1F1B's with B in place of the whole backward, so the first
    backward reaches rank 0 sooner; rank r holds back its first r weight passes (W follows B at
    a lag of r microbatches) and runs them in the cool-down, where 1F1B idles. Every rank then
    has at most pp microbatches forwarded and not yet through W: rank 0's 1F1B peak. Bubble per
    rank for uniform costs: (pp - 1)(F + B - W) against 1F1B's (pp - 1)(F + B + W).
    """
    check_schedule_args(pp_size, num_microbatches)
    _check_rank(pp_size, pp_rank)
    m, lag = num_microbatches, pp_rank
    num_warmup = min(pp_size - pp_rank - 1, m)
    F, B, W = (
        (lambda mb: Action("forward", mb)),
        (lambda mb: Action("backward", mb)),
        (lambda mb: Action("weight", mb)),
    )
    computes = [F(mb) for mb in range(num_warmup)]
    next_w = 0
    for i in range(m - num_warmup):
        computes += [F(num_warmup + i), B(i)]
        if i >= lag:
            computes.append(W(next_w))
            next_w += 1
    for mb in range(m - num_warmup, m):
        computes.append(B(mb))
        computes.append(W(next_w))
        next_w += 1
    computes += [W(mb) for mb in range(next_w, m)]
    return with_comm(computes, pp_size, pp_rank)


def zb_v(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """ZB-V's table for `pp_rank` (see `_zb_v_computes`), receives in each sender's order."""
    return _v_table(_zb_v_computes, "zb-v", pp_size, pp_rank, num_microbatches)


def _v_table(computes, name: str, pp_size: int, pp_rank: int, num_microbatches: int):
    """`pp_rank`'s table of a V-placement schedule whose per-rank compute order `computes`
    gives: sends and receives put in, receives in each sender's order."""
    check_schedule_args(pp_size, num_microbatches, 2, name)
    _check_rank(pp_size, pp_rank)
    tables = [
        with_comm(computes(pp_size, r, num_microbatches), pp_size, r, 2, "v")
        for r in range(pp_size)
    ]
    return receive_in_send_order(tables, "v")[pp_rank]


def _zb_v_computes(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, "Zero Bubble (Almost) Pipeline Parallelism"): two chunks per rank in
    the V placement (rank r holds virtual stages r and 2 * pp - 1 - r, so the loss is on rank
    0 and the turn from chunk 0 to chunk 1 stays on the last rank), backward split into B and W.

    Rank r: 2(pp - r) - 1 forwards of chunk 0; r pairs (chunk-1 forward, chunk-0 forward); pp - r
    rounds of chunk 1's F, B, W; then the steady round (F, B, W of chunk 0, then of chunk 1)
    until every forward is issued; the cool-down runs r pairs of backwards (chunk 0, chunk 1),
    pp - r rounds (chunk-0 B, its oldest pending W) and last the pending W of chunk 1, then of
    chunk 0. Fewer than 2 * pp - 1 microbatches: the order of 2 * pp - 1 with the missing ones
    left out. Peak activations: 2 * pp chunk-microbatches per rank, 1F1B's pp whole-model ones.
    """
    p, r, m = pp_size, pp_rank, num_microbatches
    n = max(m, 2 * p - 1)
    issued = {"forward": [0, 0], "backward": [0, 0], "weight": [0, 0]}  # next mb, per chunk
    computes: list[Action] = []

    def run(kind: str, chunk: int) -> None:
        computes.append(Action(kind, issued[kind][chunk], chunk))
        issued[kind][chunk] += 1

    for _ in range(2 * (p - r) - 1):
        run("forward", 0)
    for _ in range(r):
        run("forward", 1)
        run("forward", 0)
    for _ in range(p - r):
        run("forward", 1)
        run("backward", 1)
        run("weight", 1)
    while issued["forward"][1] < issued["forward"][0] or issued["forward"][0] < n:
        if issued["forward"][0] < n:
            run("forward", 0)
        for chunk in (0, 1):
            if chunk == 1:
                run("forward", 1)
            run("backward", chunk)
            run("weight", chunk)
    for _ in range(r):
        run("backward", 0)
        run("backward", 1)
    for _ in range(p - r):
        run("backward", 0)
        run("weight", 0)
    for chunk in (1, 0):
        while issued["weight"][chunk] < issued["backward"][chunk]:
            run("weight", chunk)
    return [a for a in computes if a.microbatch < m]


def dualpipev(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """DualPipeV's table for `pp_rank` (see `_dualpipev_computes`), receives in each sender's
    order."""
    return _v_table(_dualpipev_computes, "dualpipev", pp_size, pp_rank, num_microbatches)


def _dualpipev_computes(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3's DualPipe, "cut in half" onto the V placement of ZB-V: rank r
    holds virtual stages r and 2·pp − 1 − r). Its main phase pairs the forward of one chunk
    with the backward of the other (F0 B1, then F1 B0: on a GPU the two overlap, so one's
    communication hides behind the other's compute; a table runs them in that order). Per
    rank r, with p = pp and m microbatches (m >= 2p), DeepSeek's eight phases:

      1. 2(p - r - 1) forwards of chunk 0          5. p - r - 1 × (B1, F1, B0)
      2. r + 1 × (F0, F1)                          6. r + 1 × (B1, B0), the later half
      3. p - r - 1 × (B1 split, its W, F1)            split (W queued)
      4. m - 2p + r + 1 × (F0, B1, F1, B0)         7. p - r - 1 × (a queued W, B0 split)
                                                   8. r + 1 queued W

    A backward not split runs its W right after it (the whole backward); a split one queues
    its W (oldest first). The loss is on rank 0 (stage 2p - 1), the turn on rank p - 1."""
    p, r, m = pp_size, pp_rank, num_microbatches
    nxt = {"forward": [0, 0], "backward": [0, 0]}  # next microbatch, per chunk
    queue: list[Action] = []  # split backwards' weight passes, oldest first
    computes: list[Action] = []

    def f(chunk: int) -> None:
        computes.append(Action("forward", nxt["forward"][chunk], chunk))
        nxt["forward"][chunk] += 1

    def b(chunk: int, split: bool) -> None:
        mb = nxt["backward"][chunk]
        nxt["backward"][chunk] += 1
        computes.append(Action("backward", mb, chunk))
        (queue.append if split else computes.append)(Action("weight", mb, chunk))

    def w() -> None:
        computes.append(queue.pop(0))

    for _ in range(2 * (p - r - 1)):
        f(0)
    for _ in range(r + 1):
        f(0)
        f(1)
    for _ in range(p - r - 1):
        b(1, split=True)
        w()
        f(1)
    for _ in range(m - 2 * p + r + 1):
        f(0)
        b(1, split=False)
        f(1)
        b(0, split=False)
    for _ in range(p - r - 1):
        b(1, split=False)
        f(1)
        b(0, split=False)
    split = False
    for i in range(r + 1):  # the later half of these backwards split (by the rank's parity)
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        b(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        b(0, split)
    for _ in range(p - r - 1):
        w()
        b(0, split=True)
    for _ in range(r + 1):
        w()
    return computes


# parallel.pipeline_schedule: name -> (vpp it needs, None: any >= 2; placement; batches)
SCHEDULES = {
    "1f1b": (1, "loop", "rendezvous"),
    "interleaved": (None, "loop", "rendezvous"),
    "zb-h1": (1, "loop", "posted"),
    "zb-v": (2, "v", "posted"),
    "dualpipev": (2, "v", "posted"),
}


def resolve_schedule(schedule: str | None, vpp: int = 1) -> str:
    """The schedule's name: None picks 1F1B or interleaved 1F1B by vpp (the default)."""
    if schedule is None:
        return "1f1b" if vpp == 1 else "interleaved"
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
    need = SCHEDULES[schedule][0]
    if (need is None and vpp < 2) or (need is not None and vpp != need):
        rule = "vpp >= 2" if need is None else f"vpp={need}"
        raise ValueError(f"pipeline schedule {schedule!r} needs {rule} (model chunks per "
                         f"pipeline rank), not vpp={vpp}")  # fmt: skip
    return schedule


def schedule_placement(schedule: str | None, vpp: int = 1) -> str:
    """Where the schedule puts the virtual stages ("loop" or "v")."""
    return SCHEDULES[resolve_schedule(schedule, vpp)][1]


def schedule_comm(schedule: str | None, vpp: int = 1) -> str:
    """How the engine runs the schedule's batches: "rendezvous" (wait for each batch) or
    "posted" (post it and wait where a compute needs what it receives)."""
    return SCHEDULES[resolve_schedule(schedule, vpp)][2]


def splits_backward(schedule: str | None, vpp: int = 1) -> bool:
    """Whether the schedule splits each backward into B (input grad) and W (weight grads)."""
    return resolve_schedule(schedule, vpp) in ("zb-h1", "zb-v", "dualpipev")


def simulate_options(schedule: str | None, vpp: int = 1) -> dict[str, str]:
    """`simulate`'s placement= and comm= for the schedule's tables."""
    return {"placement": schedule_placement(schedule, vpp), "comm": schedule_comm(schedule, vpp)}


def get_schedule(
    pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1, schedule: str | None = None
) -> list[Action]:
    """The action list of `pp_rank`: no pipelining (pp = 1), else `schedule` (None: 1F1B or
    interleaved 1F1B by vpp)."""
    check_schedule_args(pp_size, num_microbatches, vpp, schedule)
    name = resolve_schedule(schedule, vpp)
    if pp_size == 1:
        return no_pipelining(num_microbatches)
    if name == "zb-h1":
        return zb_h1(pp_size, pp_rank, num_microbatches)
    if name == "zb-v":
        return zb_v(pp_size, pp_rank, num_microbatches)
    if name == "dualpipev":
        return dualpipev(pp_size, pp_rank, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(pp_size, pp_rank, num_microbatches)
    return interleaved_one_f_one_b(pp_size, pp_rank, num_microbatches, vpp)


def forward_only(
    pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1, placement: str = "loop"
) -> list[Action]:
    """Evaluation: each microbatch through this rank's chunks in virtual-stage order, forwards
    only (receive, forward, send), with no activation kept for a backward. Under the V
    placement the turn (chunk 0 to chunk 1 on the last rank) stays on the rank: no send."""
    check_schedule_args(pp_size, num_microbatches, vpp)
    _check_rank(pp_size, pp_rank)
    last, actions = pp_size * vpp - 1, []

    def remote(stage: int) -> bool:
        return 0 <= stage <= last and stage_location(stage, pp_size, placement)[0] != pp_rank

    for mb in range(num_microbatches):
        for chunk in range(vpp):
            stage = virtual_stage(pp_rank, chunk, pp_size, placement)
            if remote(stage - 1):
                actions.append(Action("recv_forward", mb, chunk))
            actions.append(Action("forward", mb, chunk))
            if remote(stage + 1):
                actions.append(Action("send_forward", mb, chunk))
    return actions


def get_schedule_table(
    pp_size: int, num_microbatches: int, vpp: int = 1, schedule: str | None = None
) -> list[list[Action]]:
    """Every rank's action list, indexed by pipeline rank (what `simulate` takes)."""
    return [get_schedule(pp_size, r, num_microbatches, vpp, schedule) for r in range(pp_size)]
