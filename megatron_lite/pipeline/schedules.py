"""Pipeline schedules as data: each table is one rank's ordered list of actions (actions.py:
`Action`, the placements, the batching rules). This module builds the 1F1B family, registers
the records of the shipped schedules (registry.py `ScheduleSpec`: 1F1B, interleaved 1F1B and
the zero-bubble tables of zero_bubble.py), gives any registered schedule's table
(`get_schedule`) and the forward-only table of evaluation. Every function is pure (no
torch.distributed); `simulate.py` checks whole tables for matched sends and receives,
deadlock-freedom and bubble.
"""

from __future__ import annotations

from megatron_lite.pipeline.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    KINDS,
    PLACEMENTS,
    RECV_OF,
    Action,
    Step,
    _batch,
    _check_rank,
    _label_receives,
    comm_batches,
    format_actions,
    peer_of,
    stage_location,
    virtual_stage,
)
from megatron_lite.pipeline.registry import (
    ScheduleSpec,
    bubble_formula,
    check_schedule_args,
    get_schedule_spec,
    in_flight,
    microbatches_problem,
    register_schedule,
    resolve_schedule,
    schedule_comm,
    schedule_names,
    schedule_placement,
    simulate_options,
    splits_backward,
)
from megatron_lite.pipeline.zero_bubble import (
    dualpipev,
    receive_in_send_order,
    with_comm,
    zb_h1,
    zb_v,
)

__all__ = [
    "COMM_KINDS", "COMPUTE_KINDS", "KINDS", "PLACEMENTS", "RECV_OF", "Action",
    "ScheduleSpec", "Step", "bubble_formula", "check_schedule_args", "comm_batches",
    "dualpipev", "format_actions", "forward_only", "get_schedule", "get_schedule_spec",
    "get_schedule_table", "in_flight", "interleaved_one_f_one_b", "microbatches_problem",
    "no_pipelining", "one_f_one_b", "peer_of", "receive_in_send_order", "register_schedule",
    "resolve_schedule", "schedule_comm", "schedule_names", "schedule_placement",
    "simulate_options", "splits_backward", "stage_location", "virtual_stage", "with_comm",
    "zb_h1", "zb_v",
]  # fmt: skip


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


def get_schedule(
    pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1, schedule: str | None = None
) -> list[Action]:
    """The action list of `pp_rank`: no pipelining (pp = 1), else the table of `schedule`'s
    record (None: 1F1B or interleaved 1F1B by vpp)."""
    check_schedule_args(pp_size, num_microbatches, vpp, schedule)
    spec = get_schedule_spec(schedule, vpp)
    if pp_size == 1:
        return no_pipelining(num_microbatches)
    _check_rank(pp_size, pp_rank)
    return spec.build(pp_size, pp_rank, num_microbatches, vpp)


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


# ------------------------------------------------------------------- the shipped schedules
def _one_f_one_b_fill(fwd: float, bwd: float, wgt: float) -> float:
    return fwd + bwd  # the first microbatch's forward down and backward up the pipeline


def _interleaved_in_flight(pp: int, vpp: int, m: int, rank: int) -> int:
    # Megatron's warm-up count plus one (chunks, each 1/vpp of the stage), all m·vpp at m = pp
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)


ONE_F_ONE_B = ScheduleSpec(
    name="1f1b",
    build=lambda pp, rank, m, vpp: one_f_one_b(pp, rank, m),
    in_flight=lambda pp, vpp, m, rank: min(pp - rank, m),  # pp - rank - 1 warm-up forwards + 1
    summary="PipeDream-flush (the default at vpp=1)",
    bubble_fill=_one_f_one_b_fill,
    bubble_rule="(pp-1)/(vpp*m)",
)
INTERLEAVED = ScheduleSpec(
    name="interleaved",
    build=interleaved_one_f_one_b,
    in_flight=_interleaved_in_flight,
    summary="Megatron's interleaved 1F1B (the default at vpp >= 2)",
    vpp=None,
    multiple_rule="microbatches pass through the model chunks in groups of pp",
    bubble_fill=_one_f_one_b_fill,
    bubble_rule="(pp-1)/(vpp*m)",
)
ZB_H1 = ScheduleSpec(
    name="zb-h1",
    build=lambda pp, rank, m, vpp: zb_h1(pp, rank, m),
    # W keeps later ranks' pairs longer: every rank holds rank 0's 1F1B count
    in_flight=lambda pp, vpp, m, rank: min(pp, m),
    summary="zero bubble at 1F1B's activation memory (Qi et al. 2024)",
    splits_backward=True,
    comm="posted",
    bubble_fill=lambda fwd, bwd, wgt: max(fwd + bwd - 2 * wgt, 0.0),
    bubble_rule="(pp-1)(F+B-W)/(m(F+B+W)), W <= B",
)
ZB_V = ScheduleSpec(
    name="zb-v",
    build=lambda pp, rank, m, vpp: zb_v(pp, rank, m),
    in_flight=lambda pp, vpp, m, rank: min(m + 1 + rank, 2 * pp),  # half-model chunks
    summary="zero bubble in the V placement (Qi et al. 2024)",
    vpp=2,
    placement="v",
    splits_backward=True,
    comm="posted",
)
DUALPIPEV = ScheduleSpec(
    name="dualpipev",
    build=lambda pp, rank, m, vpp: dualpipev(pp, rank, m),
    in_flight=lambda pp, vpp, m, rank: 2 * pp + 1,  # half-model chunks
    summary="DeepSeek-V3's DualPipe cut in half onto the V placement",
    vpp=2,
    placement="v",
    splits_backward=True,
    comm="posted",
    min_microbatches=lambda pp, vpp: 2 * pp,
    min_formula="2·pp",
    min_why=(
        "each rank's warm-up forwards 2·(pp - rank) - 1 microbatches before its first backward"
    ),
)
for _spec in (ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZB_V, DUALPIPEV):  # the docs' table's order
    register_schedule(_spec)
