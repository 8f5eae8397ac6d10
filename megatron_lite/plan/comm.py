"""Collective cost model: ring time on the slowest link a group crosses, from the bytes each
rank sends (`comm_stats.bus_bytes`, NCCL-tests' bus convention: the unit the measured comm
stats report, so planner and measurement speak one unit)."""

from __future__ import annotations

import functools

from megatron_lite.parallel.comm_stats import bus_bytes
from megatron_lite.parallel.mesh import RankLayout

# ring steps per collective (latency term): all-reduce is a reduce-scatter plus an all-gather
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "send": 0}
LATENCY_S = {"nvlink": 3e-6, "ib": 8e-6}  # per ring step, typical NCCL small-message figures


def collective_time(op: str, size_bytes: float, n: int, link: str, gpu) -> float:
    """Seconds for a ring `op` over n ranks whose slowest link is `link` (nvlink | ib)."""
    if n <= 1 and op != "send":
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
        nodes = layout.group_array(name) // gpus_per_node  # [groups, group size]
        spans = bool((nodes.min(axis=1) != nodes.max(axis=1)).any())
        out[name] = "ib" if spans else "nvlink"
    return out
