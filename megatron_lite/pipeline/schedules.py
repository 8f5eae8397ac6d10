"""Pipeline schedules as data: each table is one rank's ordered list of actions (actions.py:
`Action`, the placements, the batching rules). This module builds the 1F1B family, owns the
registry of named schedules (`SCHEDULES`: the vpp each needs, its placement, how its batches
run) and `get_schedule`, which also gives the zero-bubble tables (zero_bubble.py), and the
forward-only table of evaluation. Every function is pure (no torch.distributed); `simulate.py`
checks whole tables for matched sends and receives, deadlock-freedom and bubble.
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
    check_schedule_args,
    comm_batches,
    format_actions,
    microbatches_problem,
    peer_of,
    stage_location,
    virtual_stage,
)
from megatron_lite.pipeline.zero_bubble import (
    dualpipev,
    receive_in_send_order,
    with_comm,
    zb_h1,
    zb_v,
)

__all__ = [
    "COMM_KINDS", "COMPUTE_KINDS", "KINDS", "PLACEMENTS", "RECV_OF", "SCHEDULES",
    "SPLIT_SCHEDULES", "Action", "Step", "check_schedule_args", "comm_batches", "dualpipev",
    "format_actions", "forward_only",
    "get_schedule", "get_schedule_table", "interleaved_one_f_one_b", "microbatches_problem",
    "no_pipelining", "one_f_one_b", "peer_of", "receive_in_send_order", "resolve_schedule",
    "schedule_comm", "schedule_placement", "simulate_options", "splits_backward",
    "stage_location", "virtual_stage", "with_comm", "zb_h1", "zb_v",
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


# the schedules whose backward is split into B (input grad) and W (weight grads)
SPLIT_SCHEDULES = ("zb-h1", "zb-v", "dualpipev")


def splits_backward(schedule: str | None, vpp: int = 1) -> bool:
    """Whether the schedule splits each backward into B (input grad) and W (weight grads)."""
    return resolve_schedule(schedule, vpp) in SPLIT_SCHEDULES


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
