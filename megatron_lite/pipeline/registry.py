"""Pipeline schedules as records: one `ScheduleSpec` per schedule holds everything the rest of
the code knows of it (the vpp it runs on, where its virtual stages sit, whether it splits the
backward into B and W, how its batches run, its microbatch-count rules and their messages, the
(microbatch, chunk) pairs each rank holds at its peak, its closed-form bubble, its table
builder). Config validation, the engine, the planner, the simulator's options, the tools and
the docs' table read the record; `register_schedule` adds one. The shipped records are
registered by pipeline/schedules.py (imported with the package).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from megatron_lite.pipeline.actions import PLACEMENTS, Action
from megatron_lite.registry import Registry

__all__ = [
    "ScheduleSpec", "bubble_formula", "check_schedule_args", "default_schedule",
    "fewest_microbatches", "get_schedule_spec", "in_flight", "microbatches_problem",
    "named_schedule", "needs_multiple", "register_schedule", "resolve_schedule", "schedule_comm",
    "schedule_names", "schedule_placement", "schedules_table", "simulate_options",
    "splits_backward", "unregister_schedule",
]  # fmt: skip

COMMS = ("rendezvous", "posted")


def _stages(pp: int, vpp: int) -> int:
    return pp


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule (the value of `parallel.pipeline_schedule`).

    build(pp, pp_rank, m, vpp): that rank's ordered actions for m microbatches (pp >= 2; pp = 1
    is plain gradient accumulation for every schedule). in_flight(pp, vpp, m, rank): the
    (microbatch, chunk) pairs rank holds at its peak, a split backward's counted until its W
    (pp >= 2; the simulator's `peak_in_flight` of the table). vpp: the model chunks per rank it
    runs on (None: any >= 2). placement: "loop" or "v" (actions.py `PLACEMENTS`). comm: how the
    engine runs its batches, "rendezvous" (wait for each) or "posted" (post, wait where a
    compute needs the input). Microbatches: every schedule needs m >= pp (the pipeline fills);
    `min_microbatches(pp, vpp)` may ask more (its formula text and why), `multiple_rule` (why)
    asks a multiple of pp when vpp > 1. bubble_fill(F, B, W): the closed-form fill-and-drain
    time per virtual stage (B a whole backward, W its weight part), the bubble being
    (pp - 1)·fill over the m·vpp·(F + B) of busy time; None: only the simulator knows it.
    """

    name: str
    build: Callable[[int, int, int, int], list[Action]]
    in_flight: Callable[[int, int, int, int], int]
    summary: str  # one line for the docs' table
    vpp: int | None = 1
    placement: str = "loop"
    splits_backward: bool = False
    comm: str = "rendezvous"
    min_microbatches: Callable[[int, int], int] = _stages
    min_formula: str = "pp"  # min_microbatches as the messages write it
    min_why: str = ""  # why more than pp ("" when it asks pp)
    multiple_rule: str = ""  # why m must be a multiple of pp when vpp > 1 ("" : no such rule)
    bubble_fill: Callable[[float, float, float], float] | None = None
    bubble_rule: str = ""  # the closed-form bubble fraction as the tools print it

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"{self.name}: placement={self.placement!r} not one of {PLACEMENTS}")
        if self.comm not in COMMS:
            raise ValueError(f"{self.name}: comm={self.comm!r} is not one of {COMMS}")
        if self.placement == "v" and self.vpp != 2:
            raise ValueError(f"{self.name}: the V placement holds 2 chunks a rank: vpp=2")


_SPECS: Registry[ScheduleSpec] = Registry("pipeline schedule")


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a schedule under `spec.name` (a name taken is an error); returns the spec."""
    return _SPECS.add(spec)


def unregister_schedule(name: str) -> None:
    """Remove a registered schedule (tests that register a toy one)."""
    _SPECS.remove(name)


def schedule_names() -> tuple[str, ...]:
    """The registered schedules, in registration order."""
    return _SPECS.names()


def default_schedule(vpp: int) -> str:
    """parallel.pipeline_schedule=null: 1F1B at vpp=1, interleaved 1F1B at vpp >= 2 (as
    Megatron picks by its virtual pipeline size)."""
    return "1f1b" if vpp == 1 else "interleaved"


def resolve_schedule(schedule: str | None, vpp: int = 1) -> str:
    """The schedule's name: None picks 1F1B or interleaved 1F1B by vpp (the default)."""
    if schedule is None:
        return default_schedule(vpp)
    if schedule not in _SPECS:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {sorted(_SPECS.names())}")
    need = _SPECS.get(schedule).vpp
    if (need is None and vpp < 2) or (need is not None and vpp != need):
        rule = "vpp >= 2" if need is None else f"vpp={need}"
        raise ValueError(f"pipeline schedule {schedule!r} needs {rule} (model chunks per "
                         f"pipeline rank), not vpp={vpp}")  # fmt: skip
    return schedule


def get_schedule_spec(schedule: str | None, vpp: int = 1) -> ScheduleSpec:
    """The record of `schedule` (None: the default by vpp), checked against vpp."""
    return _SPECS.get(resolve_schedule(schedule, vpp))


def schedule_placement(schedule: str | None, vpp: int = 1) -> str:
    """Where the schedule puts the virtual stages ("loop" or "v")."""
    return get_schedule_spec(schedule, vpp).placement


def schedule_comm(schedule: str | None, vpp: int = 1) -> str:
    """How the engine runs the schedule's batches: "rendezvous" (wait for each batch) or
    "posted" (post it and wait where a compute needs what it receives)."""
    return get_schedule_spec(schedule, vpp).comm


def splits_backward(schedule: str | None, vpp: int = 1) -> bool:
    """Whether the schedule splits each backward into B (input grad) and W (weight grads)."""
    return get_schedule_spec(schedule, vpp).splits_backward


def simulate_options(schedule: str | None, vpp: int = 1) -> dict[str, str]:
    """`simulate`'s placement= and comm= for the schedule's tables."""
    spec = get_schedule_spec(schedule, vpp)
    return {"placement": spec.placement, "comm": spec.comm}


def in_flight(
    pp: int, vpp: int, num_microbatches: int, rank: int, schedule: str | None = None
) -> int:
    """(microbatch, chunk) pairs whose activations pipeline rank `rank` holds at its peak (a
    split backward's counted until W): the record's count, 1 without pipelining."""
    if pp == 1:
        return 1
    return get_schedule_spec(schedule, vpp).in_flight(pp, vpp, num_microbatches, rank)


def bubble_formula(
    schedule: str | None, pp: int, vpp: int, m: int, fwd=1, bwd=2, wgt=None
) -> Fraction | float | None:
    """The record's closed-form bubble fraction idle / busy, (pp - 1)·fill / (m·vpp·(F + B)),
    at these per-chunk costs (`wgt`: W's part of a split backward, None: half), or None."""
    spec = get_schedule_spec(schedule, vpp)
    if spec.bubble_fill is None:
        return None
    if wgt is None:
        wgt = bwd / 2 if spec.splits_backward else 0
    return (pp - 1) * spec.bubble_fill(fwd, bwd, wgt) / (vpp * m * (fwd + bwd))


def named_schedule(schedule: str | None, vpp: int = 1) -> ScheduleSpec | None:
    """The record by name only (None: the default by vpp), without the vpp check (the
    microbatch rules and validation's fix are worded apart from it); None if not registered."""
    return _SPECS.get(default_schedule(vpp) if schedule is None else schedule)


def microbatches_problem(
    pp_size: int, num_microbatches: int, vpp: int = 1, schedule: str | None = None
) -> str | None:
    """Why the pipeline schedule cannot run `num_microbatches` on (pp, vpp), or None: the one
    owner of the microbatch-count rules (config validation words its message from this)."""
    m = num_microbatches
    if pp_size == 1:
        return None
    if m < pp_size:
        return (
            f"num_microbatches={m} must be >= pp={pp_size} for the 1F1B "
            f"schedule: with fewer than the {pp_size} pipeline stages the pipeline never fills"
        )
    spec = named_schedule(schedule, vpp)
    if spec is None:
        return None
    fewest = spec.min_microbatches(pp_size, vpp)
    if m < fewest:
        return (
            f"num_microbatches={m} must be >= {spec.min_formula}={fewest} for the "
            f"{spec.name} schedule: {spec.min_why}"
        )
    if spec.multiple_rule and vpp > 1 and m % pp_size:
        return (
            f"num_microbatches={m} must be a multiple of pp={pp_size} for the {spec.name} "
            f"schedule (vpp={vpp}): {spec.multiple_rule}"
        )
    return None


def fewest_microbatches(pp_size: int, vpp: int = 1, schedule: str | None = None) -> int:
    """The fewest microbatches the schedule runs on (pp, vpp) (its fixes quote it)."""
    spec = named_schedule(schedule, vpp)
    return max(pp_size, spec.min_microbatches(pp_size, vpp) if spec else pp_size)


def needs_multiple(pp_size: int, vpp: int = 1, schedule: str | None = None) -> bool:
    """Whether the schedule runs only multiples of pp microbatches on (pp, vpp)."""
    spec = named_schedule(schedule, vpp)
    return bool(pp_size > 1 and vpp > 1 and spec and spec.multiple_rule)


def check_schedule_args(
    pp_size: int, num_microbatches: int, vpp: int = 1, schedule: str | None = None
) -> None:
    """Reject degree/microbatch combinations the schedule does not support, with the rule and
    a fix."""
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
    fewest = fewest_microbatches(pp_size, vpp, schedule)
    if num_microbatches < fewest:
        more = " (the bubble is (pp-1)/num_microbatches, so more is better)"
        raise ValueError(f"{problem}; use num_microbatches >= {fewest}{more * (fewest == pp_size)}")
    lower = num_microbatches // pp_size * pp_size
    raise ValueError(f"{problem}; use num_microbatches={lower} or {lower + pp_size}, or vpp=1")


def schedules_table() -> str:
    """The docs' table of the registered schedules (docs/pipeline.md, "Schedules")."""
    rows = [
        "| schedule | vpp | placement | B/W split | batches | microbatches | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in _SPECS:
        count = f"≥ {s.min_formula}" + (", a multiple of pp" if s.multiple_rule else "")
        vpp = "≥ 2" if s.vpp is None else str(s.vpp)
        split = "yes" if s.splits_backward else "no"
        rows.append(
            f"| `{s.name}` | {vpp} | {s.placement} | {split} | {s.comm} | {count} | {s.summary} |"
        )
    return "\n".join(rows)
