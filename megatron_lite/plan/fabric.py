"""Measured collective times (tools/bench_comm.py's JSON file) for the planner: `load_fabric`
reads and checks a file, `Fabric.time` answers "how long does this collective take here".

Sizes are the planner's `size_bytes` (plan/comm.py `collective_time`, parallel/comm_stats.py
`bus_bytes`), which is nccl-tests' size S (doc/PERFORMANCE.md of NVIDIA/nccl-tests) for every
op: the tensor for all_reduce, the full gathered tensor for all_gather (n times one rank's
input), the full input for reduce_scatter (n times one rank's output), one rank's whole input
for all_to_all, and the message for send (nccl-tests' sendrecv: every rank sends S to the next
rank of its group and receives S from the previous one). So `bus_bytes(op, S, n)` is the bytes
one rank moves, and busbw = bus_bytes / time.

How `Fabric.time(op, S, n, scope)` answers from the measured points of (op, scope):
- group size: the measured n itself, else the nearest measured one m (ratio n/m closest to 1 in
  log; a tie goes to the larger m), scaled by bus_bytes(op, S, n) / bus_bytes(op, S, m): the bus
  bandwidth at a given size is taken as independent of n, which holds for ring algorithms'
  bandwidth term (nccl-tests' reason for busbw) but not for their latency term (n-1 steps), so a
  small message on more ranks than measured comes out optimistic.
- inside the measured sizes: log-log interpolation of time over bytes between the two measured
  sizes around S (exact at a measured size; a power law, so monotone between two points).
  Two groups of the same size and scope measured at the same bytes (dp and ep, say): the
  slower time.
- below the smallest measured size: that size's time (the latency floor).
- above the largest: the latency-plus-bandwidth (α-β) line through the smallest and the largest
  measured points, t(S) = t_k + (bus(S) - bus(S_k)) / B with B = (bus(S_k) - bus(S_0)) /
  (t_k - t_0): the smallest size's latency plus the bytes at the bus bandwidth the largest
  sizes reached net of it; continuous at S_k, and exact where the measured times follow
  t = α + bus / B. When the times did not grow over the range (t_k <= t_0: latency-bound sizes
  only, noise), B is the largest size's busbw.
- an (op, scope) that was not measured: None (the caller keeps its datasheet figure).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field

from megatron_lite.config import ConfigError
from megatron_lite.parallel.comm_stats import bus_bytes

FORMAT = "megatron_lite.fabric"
VERSION = 1
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
SCOPES = ("intra", "inter")  # a group inside one node | a group that spans nodes
ENTRY_KEYS = ("n", "bytes", "time_s", "algbw", "busbw")
FIX = "rerun tools/bench_comm.py to write it, or fix the file by hand (docs/bench_comm.md)"
BW_RTOL = 1e-3  # algbw/busbw are written unrounded; a wrong unit or factor is off by far more


class FabricError(ConfigError):
    """A fabric file that cannot be used; the message names the file, the field and the fix."""


@dataclass
class Fabric:
    """Measured times of one fabric file. `curves[(op, scope)][n]` is [(bytes, seconds)] sorted
    by bytes, one point per size (the slowest group's where several were measured)."""

    path: str
    backend: str
    world: int
    curves: dict[tuple[str, str], dict[int, list[tuple[float, float]]]] = field(
        default_factory=dict
    )
    meta: dict = field(default_factory=dict)  # the file's other top-level fields (host, ...)

    def measured(self) -> list[tuple[str, str, int]]:
        """Every (op, scope, n) with a curve."""
        return sorted((op, s, n) for (op, s), by_n in self.curves.items() for n in by_n)

    def time(self, op: str, size_bytes: float, n: int, scope: str) -> float | None:
        """Seconds for `op` of nccl-tests size `size_bytes` (see the module doc) over `n` ranks
        in `scope` ('intra' | 'inter'); None when that op and scope were not measured (an op
        the planner knows but no file holds, such as broadcast, too)."""
        if scope not in SCOPES:
            raise ValueError(f"Fabric.time: scope={scope!r} must be one of {SCOPES}")
        bus_bytes(op, 1, 2)  # an op the planner does not know: its ValueError
        by_n = self.curves.get((op, scope))
        if not by_n:
            return None
        if size_bytes <= 0 or (n <= 1 and op != "send"):
            return 0.0  # nothing moves
        m = min(by_n, key=lambda k: (abs(math.log(n / k)), -k))
        t = _on_curve(by_n[m], size_bytes, bus_bytes(op, size_bytes, m))
        if m == n or op == "send":
            return t
        return t * bus_bytes(op, size_bytes, n) / bus_bytes(op, size_bytes, m)


def _on_curve(points: list[tuple[float, float]], size: float, bus: float) -> float:
    """Time at `size` (its bus bytes `bus`) on one curve [(bytes, seconds)] (module doc)."""
    sizes = [b for b, _ in points]
    i = bisect.bisect_left(sizes, size)
    if i < len(sizes) and sizes[i] == size:
        return points[i][1]  # a measured size: its time, unrounded
    if size < sizes[0]:
        return points[0][1]
    if size > sizes[-1]:
        (s0, t0), (sk, tk) = points[0], points[-1]
        bus_0, bus_k = bus * s0 / size, bus * sk / size  # bus bytes ∝ size at a fixed n
        rate = (bus_k - bus_0) / (tk - t0) if tk > t0 else bus_k / tk  # B, bytes per second
        return tk + (bus - bus_k) / rate
    (b0, t0), (b1, t1) = points[i - 1], points[i]
    w = math.log(size / b0) / math.log(b1 / b0)
    return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


# ------------------------------------------------------------------ reading and checking
def load_fabric(path: str) -> Fabric:
    """Read and check a fabric file (docs/bench_comm.md's format); FabricError names what is
    wrong in it and how to fix it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise FabricError(
            f"fabric file {path}: cannot read it ({e.strerror}). Fix: {FIX}"
        ) from None
    except json.JSONDecodeError as e:
        raise FabricError(
            f"fabric file {path}: not JSON (line {e.lineno} column {e.colno}: {e.msg}). Fix: {FIX}"
        ) from None
    if not isinstance(data, dict):
        _bad(path, "the top level", data, "must be a JSON object")
    if data.get("format") != FORMAT:
        _bad(path, "format", data.get("format"), f"must be {FORMAT!r}")
    if data.get("version") != VERSION:
        _bad(path, "version", data.get("version"), f"must be {VERSION} (this planner's format)")
    backend, world, ops = data.get("backend"), data.get("world"), data.get("ops")
    if not isinstance(backend, str) or not backend:
        _bad(path, "backend", backend, "must name the backend measured (gloo, nccl)")
    if not _is_int(world) or world < 2:
        _bad(path, "world", world, "must be the number of ranks measured, an integer >= 2")
    if not isinstance(ops, dict):
        _bad(path, "ops", ops, "must map op -> scope -> list of measured points")
    curves = {}
    for op, scopes in ops.items():
        if op not in OPS:
            _bad(path, f"ops.{op}", None, f"is not an op; the ops are {', '.join(OPS)}")
        if not isinstance(scopes, dict):
            _bad(path, f"ops.{op}", scopes, "must map scope (intra | inter) -> list of points")
        for scope, entries in scopes.items():
            if scope not in SCOPES:
                _bad(path, f"ops.{op}.{scope}", None, "is not a scope; the scopes are intra, inter")
            curves[(op, scope)] = _curves(path, op, scope, entries)
    meta = {k: v for k, v in data.items() if k not in ("ops",)}
    return Fabric(path, backend, world, {k: v for k, v in curves.items() if v}, meta)


def _curves(path: str, op: str, scope: str, entries) -> dict[int, list[tuple[float, float]]]:
    """{n: [(bytes, seconds)] sorted} of one op and scope, each entry checked."""
    where = f"ops.{op}.{scope}"
    if not isinstance(entries, list):
        _bad(path, where, entries, "must be a list of {n, bytes, time_s, algbw, busbw}")
    by_n: dict[int, dict[float, float]] = {}
    for i, e in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(e, dict):
            _bad(path, at, e, "must be an object {n, bytes, time_s, algbw, busbw}")
        for key in ENTRY_KEYS:
            if key not in e:
                _bad(
                    path,
                    f"{at}.{key}",
                    None,
                    f"is missing (every point has {', '.join(ENTRY_KEYS)})",
                )
        n, size, t = e["n"], e["bytes"], e["time_s"]
        if not _is_int(n) or n < 2:
            _bad(path, f"{at}.n", n, "must be the group's size, an integer >= 2")
        for key in ("bytes", "time_s", "algbw", "busbw"):
            if not _is_positive(e[key]):
                _bad(path, f"{at}.{key}", e[key], "must be a finite number > 0")
        _check_bandwidths(path, at, op, e)
        points = by_n.setdefault(n, {})
        points[float(size)] = max(points.get(float(size), 0.0), float(t))
    return {n: sorted(points.items()) for n, points in sorted(by_n.items())}


def _check_bandwidths(path: str, at: str, op: str, e: dict) -> None:
    """algbw = bytes / time_s and busbw = bus_bytes / time_s, both in GB/s (nccl-tests')."""
    expected = {
        "algbw": e["bytes"] / e["time_s"] / 1e9,
        "busbw": bus_bytes(op, e["bytes"], e["n"]) / e["time_s"] / 1e9,
    }
    for key, want in expected.items():
        if abs(e[key] - want) > BW_RTOL * want:
            rule = "bytes / time_s" if key == "algbw" else f"bus_bytes({op!r}) / time_s"
            _bad(
                path, f"{at}.{key}", e[key],
                f"is not {rule} = {want:.6g} GB/s (1e9 bytes/s, nccl-tests' unit and factors)",
            )  # fmt: skip


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_positive(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _bad(path: str, key: str, value, rule: str):
    shown = "" if value is None else f"={value!r}"
    raise FabricError(f"fabric file {path}: {key}{shown} {rule}. Fix: {FIX}")
