"""The communication budget of a step: per collective group (TP, CP, EP, DP, PP) and scope
(inside a node, across nodes) the bytes one rank sends (NCCL-tests' bus bytes,
comm_stats.bus_bytes), the seconds they take by the model (or a fabric's measurement), and how
much of that the step exposes; the rest overlaps compute. plan/step_time.py fills it while it
times the step, so the budget and the step time are one computation."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.parallel.comm_stats import bus_bytes
from megatron_lite.plan.comm import Link, choose, collective_time

GROUPS = ("TP", "CP", "EP", "DP", "PP")


@dataclass
class CommLine:
    """One group's collectives of one scope over a step, on the busiest rank."""

    group: str  # TP | CP | EP | DP | PP (DP: gradient and weight traffic; HSDP's replicas too)
    scope: str  # intra | inter (node)
    ops: dict[str, float] = field(default_factory=dict)  # op -> calls per step
    bytes: float = 0.0  # bus bytes one rank sends per step
    seconds: float = 0.0  # their modelled seconds, overlapped or not
    exposed: float = 0.0  # what the step waits for
    algos: set[str] = field(default_factory=set)  # NCCL algorithms chosen (detail only)
    n: int = 0  # the group's size (the largest op's)

    @property
    def hidden(self) -> float:
        return max(self.seconds - self.exposed, 0.0)


class Budget:
    """Accumulates CommLines; `detail` also records each op's chosen algorithm (the plan's
    report; the search skips it)."""

    def __init__(self, node, detail: bool = False):
        self.node, self.detail = node, detail
        self.lines: dict[tuple[str, str], CommLine] = {}

    def add(self, group: str, op: str, size: float, n: int, link: Link, calls: float,
            label: str | None = None) -> float:  # fmt: skip
        """Record `calls` of `op` on `size` bytes over n ranks; the seconds of one call."""
        if (n <= 1 and op != "send") or size <= 0:
            return 0.0
        t = collective_time(op, size, n, link, self.node)
        if calls <= 0:
            return t
        line = self.lines.setdefault(
            (label or group, link.scope), CommLine(label or group, link.scope)
        )
        line.ops[op] = line.ops.get(op, 0.0) + calls
        line.bytes += calls * bus_bytes(op, size, n)
        line.seconds += calls * t
        line.n = max(line.n, n)
        if self.detail:
            fabric = self.node.fabric
            if fabric is not None and fabric.time(op, size, n, link.scope) is not None:
                line.algos.add("measured")
            else:
                line.algos.add(choose(op, size, n, link, self.node)[0])
        return t

    def expose(self, group: str, seconds: float) -> None:
        """Mark `seconds` of `group` exposed, shared over its lines by their seconds."""
        lines = [v for (g, _), v in self.lines.items() if g.split()[0] == group]
        total = sum(v.seconds for v in lines)
        for v in lines:
            v.exposed += seconds * (v.seconds / total if total else 1.0 / len(lines))

    def table(self) -> list[CommLine]:
        order = {g: i for i, g in enumerate(GROUPS)}
        return sorted(
            self.lines.values(),
            key=lambda v: (order.get(v.group.split()[0], 9), v.group, v.scope != "intra"),
        )

    def cross_node(self) -> tuple[float, float]:
        """(bytes, seconds) one rank sends across nodes per step."""
        inter = [v for v in self.lines.values() if v.scope == "inter"]
        return sum(v.bytes for v in inter), sum(v.seconds for v in inter)
