"""NCCL's algorithms as α–β formulas: the seconds a collective takes by ring, tree or NVLS, and
the choice between them as NCCL's tuner makes it (the fastest by its own model).

The model is NCCL's (src/graph/tuning.cc, NCCL 2.19, Simple protocol — the one bulk transfers
use; LL and LL128 lower small messages' latency and are left out): time = latency + bytes /
algorithm bandwidth, with the bus bandwidth B the links give (plan/comm.py) and
- ring: latency base + (steps − inter-node steps)·intra + inter-node steps·inter, steps
  2(n−1) for all-reduce (inter-node steps 2·nodes), n−1 for all-gather and reduce-scatter
  (nodes−1), n for broadcast (tuning.cc's formula as is, also where one rank per node makes
  the intra-node steps negative); algorithm bandwidth B·n/steps, i.e. NCCL-tests' bus bandwidth
  busbw = algbw·2(n−1)/n for all-reduce and algbw·(n−1)/n for all-gather / reduce-scatter;
- tree (all-reduce only): latency 2·((n/nodes − 1)·intra + log2(nodes)·inter), growing with
  log n across nodes where the ring's grows with n; algorithm bandwidth 0.92·B / 2;
- NVLS (all-reduce inside one NVSwitch node with NVLink SHARP: the switch reduces): latency
  23 µs, algorithm bandwidth 5/6·B.
All-to-all and send are point-to-point (no algorithm choice): every peer at once, one step of
latency. Seconds, bytes, GB/s = 1e9 B/s.
"""

from __future__ import annotations

import math

# tuning.cc's baseLat and hwLat (µs, Simple protocol) in seconds; hw: nvlink | pcie | net
BASE_LAT = {"ring": 8.4e-6, "tree": 0.0, "nvls": 0.0}
HW_LAT = {
    "nvlink": {"ring": 3.4e-6, "tree": 28e-6, "nvls": 23e-6},
    "pcie": {"ring": 5.7e-6, "tree": 28e-6, "nvls": 0.0},
    "net": {"ring": 14e-6, "tree": 28e-6, "nvls": 18e-6},
}
TREE_BUSBW = 0.92  # tree's bus bandwidth over the ring's (tuning.cc: busBw * .92)
NVLS_ALGBW = 5 / 6  # NVLS all-reduce: algorithm bandwidth over bus bandwidth
BUSBW_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "broadcast")


def busbw_factor(op: str, n: int) -> float:
    """NCCL-tests' busbw / algbw: 2(n−1)/n all-reduce, (n−1)/n all-gather, reduce-scatter and
    all-to-all, 1 for send and broadcast."""
    if op in ("send", "broadcast"):
        return 1.0
    return BUSBW_FACTOR[op] * (n - 1) / n


def ring(op: str, n: int, nodes: int, busbw: float, intra: str) -> tuple[float, float]:
    """(latency s, algorithm bandwidth B/s) of the ring over n ranks on `nodes` nodes, bus
    bandwidth `busbw` (B/s), `intra` the hardware inside a node (nvlink | pcie)."""
    if op == "all_reduce":
        steps, inter = 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    elif op == "broadcast":
        steps, inter = n, nodes if nodes > 1 else 0
    else:
        steps, inter = n - 1, nodes - 1
    lat = BASE_LAT["ring"] + (steps - inter) * HW_LAT[intra]["ring"] + inter * HW_LAT["net"]["ring"]
    return lat, busbw / busbw_factor(op, n)


def tree(n: int, nodes: int, busbw: float, intra: str) -> tuple[float, float]:
    """(latency, algorithm bandwidth) of NCCL's tree all-reduce: a chain inside each node,
    a double binary tree across nodes, up then down."""
    per_node = max(n // nodes, 1)
    hops = (per_node - 1) * HW_LAT[intra]["tree"] + _log2i(nodes) * HW_LAT["net"]["tree"]
    return BASE_LAT["tree"] + 2 * hops, TREE_BUSBW * busbw / 2


def nvls(busbw: float) -> tuple[float, float]:
    """(latency, algorithm bandwidth) of NVLS all-reduce inside one NVSwitch node."""
    return BASE_LAT["nvls"] + HW_LAT["nvlink"]["nvls"], NVLS_ALGBW * busbw


def point_to_point(op: str, n: int, nodes: int, busbw: float, intra: str) -> tuple[float, float]:
    """(latency, algorithm bandwidth) of send and all-to-all: one step, peers at once."""
    hw = "net" if nodes > 1 else intra
    return BASE_LAT["ring"] + HW_LAT[hw]["ring"], busbw / busbw_factor(op, max(n, 2))


def _log2i(x: int) -> int:
    """NCCL's log2i: floor(log2 x), 0 for x <= 1."""
    return int(math.floor(math.log2(x))) if x > 1 else 0


def seconds(lat_bw: tuple[float, float], size_bytes: float) -> float:
    lat, bw = lat_bw
    return lat + size_bytes / bw


def fastest(options: dict[str, tuple[float, float]], size_bytes: float) -> tuple[str, float]:
    """(algorithm, seconds): the fastest of `options` {name: (latency, algbw)} for this size,
    as NCCL's tuner picks by its model (ties: the first)."""
    best = min(options, key=lambda a: seconds(options[a], size_bytes))
    return best, seconds(options[best], size_bytes)


def crossing(a: tuple[float, float], b: tuple[float, float]) -> float | None:
    """The message size (bytes) where two algorithms take equal time, None if they never do
    at a positive size: lat_a + S/bw_a = lat_b + S/bw_b."""
    (la, ba), (lb, bb) = a, b
    slope = 1 / ba - 1 / bb
    if slope == 0:
        return None
    s = (lb - la) / slope
    return s if s > 0 else None
