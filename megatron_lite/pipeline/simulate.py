"""Execute a whole schedule table (every rank's actions) without processes.

`simulate` checks that a table is executable and measures it:
- every send meets its receive: on each link (src -> dst) the n-th send matches the n-th
  receive (FIFO, as NCCL matches p2p ops) and both name the same microbatch and stage pair;
- no deadlock under rendezvous semantics: a batch posts all its ops at once and completes when
  every op's peer has posted its match (a send waits for the receive: no eager buffering);
- data dependencies: a stage receives its input before its forward (or, where the previous
  stage is on the same rank, runs after that stage's forward), forwards before its backward,
  computes before it sends, runs a weight pass only after its backward; every (microbatch,
  virtual stage) gets exactly one forward and one backward, and one weight pass when the
  table splits its backwards (B: input grad, W: weight grad).
It reports the makespan, per-rank busy/idle time, peak in-flight activations and the bubble
fraction idle / busy (the Megatron paper's bubble time over ideal time: (pp-1)/m for 1F1B and
(pp-1)/(vpp*m) for interleaved with forward_cost=1, backward_cost=2, comm_cost=0). Costs are
per chunk action; integer or Fraction costs give exact Fraction results.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from megatron_lite.pipeline.schedules import (
    RECV_OF,
    Action,
    Step,
    peer_of,
    stage_location,
    virtual_stage,
)


class ScheduleError(ValueError):
    """A table that cannot run: unmatched or mismatched p2p, or a broken data dependency."""


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on a batch whose peer ops are never posted.

    `waits` lists (rank, action index, action, peer rank, peer's action index) for each op that
    cannot complete.
    """

    def __init__(self, message: str, waits: list[tuple[int, int, Action, int, int]]):
        super().__init__(message)
        self.waits = waits


@dataclass(frozen=True)
class Span:
    """One action's time interval on one rank (comm ops: from posting to completion)."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Measurements of one simulated table; per-rank tuples are indexed by pipeline rank."""

    pp_size: int
    vpp: int
    num_microbatches: int
    makespan: float  # Fraction/int for exact costs, like every time below
    busy: tuple[float, ...]  # compute time per rank
    idle: tuple[float, ...]  # makespan - busy per rank
    bubble_per_rank: tuple[float, ...]  # idle / busy per rank
    bubble_fraction: float  # sum(idle) / sum(busy)
    peak_in_flight: tuple[int, ...]  # most forwarded-not-yet-backwarded (microbatch, chunk)
    spans: tuple[Span, ...]


@dataclass
class _Op:
    rank: int
    index: int  # position in the rank's flat action list
    action: Action
    partner: _Op | None = None
    posted_at: float | None = None


def _normalize(table: list[Step]) -> list[list[tuple[int, Action]]]:
    """Steps of (flat index, action): compute alone, consecutive comm actions as one batch.

    A tuple in the table is one batch as given; bare comm actions next to each other merge.
    """
    steps: list[list[tuple[int, Action]]] = []
    index, bare_batch_open = 0, False
    for item in table:
        if isinstance(item, tuple):
            if not item or any(not a.is_comm for a in item):
                raise ScheduleError(f"batch at action {index} must hold send/recv only: {item}")
            steps.append([(index + n, a) for n, a in enumerate(item)])
            index, bare_batch_open = index + len(item), False
            continue
        if item.is_comm and bare_batch_open:
            steps[-1].append((index, item))
        else:
            steps.append([(index, item)])
        index, bare_batch_open = index + 1, item.is_comm
    return steps


def _check_stages(tables: list[list[Action]], vpp: int, placement: str = "loop") -> None:
    """Each action names a valid chunk and peer; each compute sees its inputs in program order."""
    pp, last = len(tables), len(tables) * vpp - 1

    def local(rank: int, stage: int) -> int | None:
        """The chunk of `stage` if it sits on `rank`, else None."""
        if not 0 <= stage <= last:
            return None
        where, chunk = stage_location(stage, pp, placement)
        return chunk if where == rank else None

    seen_by_stage: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, actions in enumerate(tables):
        done: set[tuple[str, int, int]] = set()
        for i, a in enumerate(actions):
            where = f"rank {rank} action {i} {a.kind}(mb={a.microbatch}, chunk={a.chunk})"
            if not 0 <= a.chunk < vpp or a.microbatch < 0:
                raise ScheduleError(f"{where}: chunk must be in [0, {vpp}), microbatch >= 0")
            stage = virtual_stage(rank, a.chunk, pp, placement)
            if a.kind in ("recv_forward", "send_backward") and stage == 0:
                raise ScheduleError(f"{where}: virtual stage 0 has no previous stage")
            if a.kind in ("send_forward", "recv_backward") and stage == last:
                raise ScheduleError(f"{where}: the last virtual stage has no next stage")
            prev, nxt = local(rank, stage - 1), local(rank, stage + 1)
            if (a.kind in ("recv_forward", "send_backward") and prev is not None) or (
                a.kind in ("send_forward", "recv_backward") and nxt is not None
            ):
                raise ScheduleError(f"{where}: the neighbouring stage is on this rank (no p2p)")
            needs = {
                "forward": [("recv_forward", a.chunk, stage > 0 and prev is None),
                            ("forward", prev, prev is not None)],
                "backward": [("forward", a.chunk, True),
                             ("recv_backward", a.chunk, stage < last and nxt is None),
                             ("backward", nxt, nxt is not None)],
                "weight": [("backward", a.chunk, True)],
                "send_forward": [("forward", a.chunk, True)],
                "send_backward": [("backward", a.chunk, True)],
            }.get(a.kind, [])  # fmt: skip
            for kind, chunk, required in needs:
                if required and (kind, a.microbatch, chunk) not in done:
                    what = kind if chunk == a.chunk else f"{kind} on chunk {chunk}"
                    raise ScheduleError(f"{where} comes before its {what}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in done:
                raise ScheduleError(f"{where} is repeated")
            done.add(key)
            if not a.is_comm:
                seen_by_stage[(a.kind, a.microbatch, stage)] = (rank, i)
    num_mb = 1 + max((mb for _, mb, _ in seen_by_stage), default=-1)
    # a table without any backward is a forward-only (evaluation) schedule
    present = {k for k, _, _ in seen_by_stage}
    kinds = tuple(k for k in ("forward", "backward", "weight") if k in present)
    for kind in kinds:
        for mb in range(num_mb):
            for stage in range(last + 1):
                if (kind, mb, stage) not in seen_by_stage:
                    rank, chunk = stage_location(stage, pp, placement)
                    raise ScheduleError(
                        f"no {kind} of microbatch {mb} on virtual stage {stage} "
                        f"(rank {rank}, chunk {chunk})"
                    )


def _pair_ops(
    steps: list[list[list[tuple[int, Action]]]], pp: int, placement: str = "loop"
) -> list[list[list[_Op]]]:
    """Wrap comm actions in _Ops and pair the n-th send with the n-th recv on each link."""
    sends, recvs = defaultdict(list), defaultdict(list)
    ops_steps = []
    for rank, rank_steps in enumerate(steps):
        ops_steps.append([])
        for step in rank_steps:
            ops = [_Op(rank, i, a) for i, a in step]
            ops_steps[-1].append(ops)
            for op in ops:
                if op.action.is_comm:
                    peer = peer_of(op.action, rank, pp, placement)[0]
                    link = (rank, peer) if op.action.is_send else (peer, rank)
                    (sends if op.action.is_send else recvs)[link].append(op)

    def name(op: _Op) -> str:
        a = op.action
        return f"rank {op.rank} action {op.index} {a.kind}(mb={a.microbatch}, chunk={a.chunk})"

    for link in sorted(set(sends) | set(recvs)):
        out, inc = sends[link], recvs[link]
        for n, (s, r) in enumerate(zip(out, inc, strict=False)):
            expected = (RECV_OF[s.action.kind], s.action.microbatch)
            if (r.action.kind, r.action.microbatch) != expected or peer_of(
                s.action, s.rank, pp, placement
            ) != (r.rank, r.action.chunk):
                raise ScheduleError(
                    f"link {link[0]}->{link[1]} message {n}: {name(s)} is received by {name(r)}"
                )
            s.partner, r.partner = r, s
        for op in out[len(inc) :] + inc[len(out) :]:
            raise ScheduleError(
                f"{name(op)} has no matching {'recv' if op.action.is_send else 'send'}"
            )
    return ops_steps


def simulate(
    tables: list[list[Step]],
    forward_cost: float = 1,
    backward_cost: float = 2,
    comm_cost: float = 0,
    stage_weights: list | None = None,
    weight_cost: float | None = None,
    placement: str = "loop",
    comm: str = "rendezvous",
) -> SimResult:
    """Run all ranks' tables together (index = pipeline rank) and measure them.

    `stage_weights[s]` scales the compute cost of virtual stage s (e.g. its layer count for an
    uneven split); None: every stage costs the same. `backward_cost` is a whole backward; in a
    table that splits it (weight actions), W costs `weight_cost` (None: half the backward) and B
    the rest, and a microbatch stays in flight until its W (W reads the saved inputs).
    `placement` says where the virtual stages sit ("loop" or "v", see schedules.PLACEMENTS).

    `comm` is how a rank treats its batches. "rendezvous": it blocks at each batch until every
    op's peer has posted its match (today's engine). "posted": it posts the batch and goes on;
    a compute waits only for the receive carrying its input, and the step ends once the rank's
    sends have landed (the zero-bubble schedules, which run W while a receive is in flight).

    Tables are flat action lists (consecutive comm actions form one batch) or lists holding
    explicit batches as tuples. Raises ScheduleError for unmatched or out-of-order p2p and
    broken dependencies, DeadlockError naming each stuck rank, action and what it waits for.
    """
    if comm not in ("rendezvous", "posted"):
        raise ValueError(f"comm={comm!r} must be 'rendezvous' or 'posted'")
    pp = len(tables)
    steps = [_normalize(t) for t in tables]
    flat = [[a for step in rank_steps for _, a in step] for rank_steps in steps]
    vpp = 1 + max((a.chunk for actions in flat for a in actions), default=0)
    _check_stages(flat, vpp, placement)
    ops_steps = _pair_ops(steps, pp, placement)
    split = any(a.kind == "weight" for actions in flat for a in actions)
    if weight_cost is None:
        exact_b = isinstance(backward_cost, int | Fraction)
        weight_cost = Fraction(backward_cost, 2) if exact_b else backward_cost / 2
    cost = {"forward": forward_cost, "backward": backward_cost - weight_cost if split else
            backward_cost, "weight": weight_cost}  # fmt: skip
    release = "weight" if split else "backward"

    # posted: a batch is posted where the program reaches it and the rank goes on; a compute
    # waits for the receive that carries its input (found here), and a rank's step ends once
    # its sends have landed
    needed = {
        (op.rank, op.action.kind.removeprefix("recv_"), op.action.microbatch, op.action.chunk): op
        for rank_steps in ops_steps
        for step in rank_steps
        for op in step
        if op.action.kind.startswith("recv_")
    }
    clock = [0] * pp
    pc = [0] * pp
    in_flight, peak, busy = [0] * pp, [0] * pp, [0] * pp
    spans: list[Span] = []
    waiting: dict[int, list[_Op]] = {}
    progress = True
    while progress:  # the run is a dataflow, so the visiting order does not change any time
        progress = False
        for rank in range(pp):
            while pc[rank] < len(ops_steps[rank]):
                ops = ops_steps[rank][pc[rank]]
                head = ops[0].action
                if not head.is_comm:
                    start = clock[rank]
                    if comm == "posted" and (key := (rank, head.kind, head.microbatch,
                                                     head.chunk)) in needed:  # fmt: skip
                        recv = needed[key]
                        if recv.partner.posted_at is None:
                            waiting[rank] = [recv]
                            break
                        start = max(start, max(recv.posted_at, recv.partner.posted_at) + comm_cost)
                    stage = virtual_stage(rank, head.chunk, pp, placement)
                    w = 1 if stage_weights is None else stage_weights[stage]
                    end = start + cost[head.kind] * w
                    spans.append(Span(rank, head.kind, head.microbatch, head.chunk, start, end))
                    busy[rank] += cost[head.kind] * w
                    in_flight[rank] += {"forward": 1, release: -1}.get(head.kind, 0)
                    peak[rank] = max(peak[rank], in_flight[rank])
                elif comm == "posted":
                    for op in ops:
                        op.posted_at = clock[rank]
                    end = clock[rank]
                else:
                    if ops[0].posted_at is None:
                        for op in ops:
                            op.posted_at = clock[rank]
                        progress = True
                    if any(op.partner.posted_at is None for op in ops):
                        waiting[rank] = [op for op in ops if op.partner.posted_at is None]
                        break
                    end = max([clock[rank]] + [op.partner.posted_at for op in ops]) + comm_cost
                    for op in ops:
                        a = op.action
                        spans.append(Span(rank, a.kind, a.microbatch, a.chunk, op.posted_at, end))
                waiting.pop(rank, None)
                clock[rank] = end
                pc[rank] += 1
                progress = True
    stuck = [r for r in range(pp) if pc[r] < len(ops_steps[r])]
    if stuck:
        raise _deadlock(stuck, waiting, ops_steps, pc)
    if comm == "posted":  # every op lands once both sides posted it; a rank ends with its sends
        for rank_steps in ops_steps:
            for op in (op for step in rank_steps for op in step if op.action.is_comm):
                end = max(op.posted_at, op.partner.posted_at) + comm_cost
                a = op.action
                spans.append(Span(op.rank, a.kind, a.microbatch, a.chunk, op.posted_at, end))
                if a.is_send:
                    clock[op.rank] = max(clock[op.rank], end)

    makespan = max(clock, default=0)
    costs = (forward_cost, backward_cost, comm_cost, weight_cost, *(stage_weights or ()))
    exact = all(isinstance(c, int | Fraction) for c in costs)
    idle = [makespan - b for b in busy]
    ratio = (lambda a, b: Fraction(a, b)) if exact else (lambda a, b: a / b)
    return SimResult(
        pp_size=pp,
        vpp=vpp,
        num_microbatches=1 + max((a.microbatch for a in flat[0]), default=-1),
        makespan=makespan,
        busy=tuple(busy),
        idle=tuple(idle),
        bubble_per_rank=tuple(ratio(i, b) if b else 0 for i, b in zip(idle, busy, strict=True)),
        bubble_fraction=ratio(sum(idle), sum(busy)) if sum(busy) else 0,
        peak_in_flight=tuple(peak),
        spans=tuple(sorted(spans, key=lambda s: (s.rank, s.start, s.end))),
    )


def _deadlock(
    stuck: list[int], waiting: dict[int, list[_Op]], ops_steps: list[list[list[_Op]]], pc: list[int]
) -> DeadlockError:
    waits, lines = [], []
    for rank in stuck:
        for op in waiting.get(rank, []):
            peer = op.partner
            at = (
                ops_steps[peer.rank][pc[peer.rank]][0]
                if pc[peer.rank] < len(ops_steps[peer.rank])
                else None
            )
            a, b = op.action, peer.action
            lines.append(
                f"rank {rank} action {op.index} {a.kind}(mb={a.microbatch}, chunk={a.chunk}) "
                f"waits for rank {peer.rank} action {peer.index} {b.kind}(mb={b.microbatch}, "
                f"chunk={b.chunk}), but rank {peer.rank} is blocked at action "
                f"{at.index if at else 'end'}"
            )
            waits.append((rank, op.index, a, peer.rank, peer.index))
    return DeadlockError("deadlock:\n  " + "\n  ".join(lines), waits)


def timeline(
    tables: list[list[Step]],
    forward_cost: float = 1,
    backward_cost: float = 2,
    comm_cost: float = 0,
    weight_cost: float | None = None,
    placement: str = "loop",
    comm: str = "rendezvous",
) -> list[Span]:
    """Spans (rank, kind, microbatch, chunk, start, end) of a simulated run, by rank and start."""
    result = simulate(
        tables, forward_cost, backward_cost, comm_cost, None, weight_cost, placement, comm
    )
    return list(result.spans)


def chrome_trace(spans: list[Span], time_unit_us: float = 1000.0) -> dict:
    """A Chrome/Perfetto trace (json.dump it): one process per rank, compute and comm rows."""
    events = []
    for s in spans:
        events.append({
            "name": f"{s.kind} mb{s.microbatch} c{s.chunk}",
            "cat": s.kind,
            "ph": "X",
            "pid": s.rank,
            "tid": "compute" if s.kind in ("forward", "backward", "weight") else s.kind,
            "ts": float(s.start) * time_unit_us,
            "dur": float(s.end - s.start) * time_unit_us,
            "args": {"microbatch": s.microbatch, "chunk": s.chunk},
        })  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}
