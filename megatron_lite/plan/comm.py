"""Collective cost model: bytes on the wire per rank (NCCL-tests' bus convention) and ring time
on the slowest link a group crosses.

`bus_bytes` matches the convention of comm_stats (issue #13 item 2); switch to
`megatron_lite.parallel.comm_stats.bus_bytes` once that exists, so planner and measurement share
one owner.
"""

from __future__ import annotations

import functools

from megatron_lite.parallel.mesh import RankLayout

# ring steps per collective (latency term): all-reduce is a reduce-scatter plus an all-gather
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "p2p": 0}
LATENCY_S = {"nvlink": 3e-6, "ib": 8e-6}  # per ring step, typical NCCL small-message figures


def bus_bytes(op: str, size_bytes: float, n: int) -> float:
    """Bytes each rank sends for `op` on `size_bytes` (the full tensor: an all-gather's output,
    a reduce-scatter's input, an all-reduce's buffer, an all-to-all's per-rank buffer) over n
    ranks: all-gather and reduce-scatter (n-1)/n·size, all-reduce 2(n-1)/n·size, all-to-all
    (n-1)/n·size, p2p the size."""
    if op == "p2p":
        return float(size_bytes)
    if n <= 1:
        return 0.0
    if op not in _STEPS:
        raise ValueError(f"unknown collective {op!r}: one of {', '.join(_STEPS)}")
    factor = 2.0 if op == "all_reduce" else 1.0
    return factor * (n - 1) / n * size_bytes


def collective_time(op: str, size_bytes: float, n: int, link: str, gpu) -> float:
    """Seconds for a ring `op` over n ranks whose slowest link is `link` (nvlink | ib)."""
    if n <= 1 and op != "p2p":
        return 0.0
    bw = (gpu.nvlink_gbps if link == "nvlink" else gpu.ib_gbps) * 1e9
    steps = _STEPS[op] * max(n - 1, 1)
    return bus_bytes(op, size_bytes, n) / bw + steps * LATENCY_S[link]


@functools.lru_cache(maxsize=4096)
def group_links(
    world: int, tp: int, pp: int, cp: int, ep: int, order: str, gpus_per_node: int
) -> dict[str, str]:
    """{group name: 'nvlink' | 'ib'}: whether a group of that kind spans nodes, from the rank
    grid of `parallel.order` (mesh.RankLayout, the one owner of the rank order). Groups of one
    kind are translates of each other, so the worst one is checked."""
    layout = RankLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
    out = {}
    for name in ("tp", "cp", "dp_cp", "ep", "edp", "pp"):
        groups = layout.groups(name)
        spans = any(len({r // gpus_per_node for r in g}) > 1 for g in groups)
        out[name] = "ib" if spans else "nvlink"
    return out
