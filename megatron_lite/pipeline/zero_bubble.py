"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism") and DeepSeek's
DualPipeV: each backward split into B (the input gradient) and W (the weight gradients), given
as each rank's compute order, with the sends and receives put in by `with_comm` and receives
reordered to each sender's order (`receive_in_send_order`) so posted batches never wait on each
other. ZB-H1 keeps 1F1B's loop placement; ZB-V and DualPipeV use the V placement
(actions.py `PLACEMENTS`)."""

from __future__ import annotations

from collections import defaultdict

from megatron_lite.pipeline.actions import (
    RECV_OF,
    Action,
    _batch,
    _check_rank,
    comm_batches,
    peer_of,
    stage_location,
    virtual_stage,
)
from megatron_lite.pipeline.registry import check_schedule_args


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
