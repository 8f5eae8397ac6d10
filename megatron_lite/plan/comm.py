"""Collective cost model: ring time on the slowest link a group crosses, from the bytes each
rank sends (`comm_stats.bus_bytes`, NCCL-tests' bus convention: the unit the measured comm
stats report, so planner and measurement speak one unit)."""

from __future__ import annotations

import functools

from megatron_lite.parallel.comm_stats import bus_bytes
from megatron_lite.parallel.mesh import RankLayout

# ring steps per collective (latency term): all-reduce is a reduce-scatter plus an all-gather
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "send": 0,
          "broadcast": 1}  # fmt: skip
LATENCY_S = {"nvlink": 3e-6, "ib": 8e-6}  # per ring step, typical NCCL small-message figures


def collective_time(op: str, size_bytes: float, n: int, link: str, gpu) -> float:
    """Seconds for a ring `op` over n ranks whose slowest link is `link` (nvlink | ib)."""
    if n <= 1 and op != "send":
        return 0.0
    bw = (gpu.nvlink_gbps if link == "nvlink" else gpu.ib_gbps) * 1e9
    steps = _STEPS[op] * max(n - 1, 1)
    return bus_bytes(op, size_bytes, n) / bw + steps * LATENCY_S[link]


def _link(nodes, axis: int) -> str:
    """'ib' when any group along `axis` of a node-number array holds two nodes."""
    return "ib" if bool((nodes.min(axis=axis) != nodes.max(axis=axis)).any()) else "nvlink"


@functools.lru_cache(maxsize=4096)
def group_links(
    world: int, tp: int, pp: int, cp: int, ep: int, order: str, gpus_per_node: int,
    cp_a2a: int | None = None,
) -> dict[str, str]:  # fmt: skip
    """{group name: 'nvlink' | 'ib'}: whether a group of that kind spans nodes, from the rank
    grid of `parallel.order` (mesh.RankLayout, the one owner of the rank order). Groups of one
    kind are translates of each other, so the worst one is checked. `cp_a2a` ranks of each CP
    group run Ulysses together (None: all of them) and the ring spans the rest: CP rank =
    ring rank · cp_a2a + a2a rank (mesh.py), so the a2a groups are consecutive CP ranks (with
    the default order inside one node first: the hybrid's point) and the ring strides them."""
    layout = RankLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order, cp_a2a=cp_a2a)
    out = {}
    for name in ("tp", "cp", "dp_cp", "ep", "edp", "pp"):
        out[name] = _link(layout.group_array(name) // gpus_per_node, 1)  # [groups, size]
    a2a = layout.a2a
    nodes = layout.group_array("cp").reshape(-1, cp // a2a, a2a) // gpus_per_node
    out["cp_a2a"], out["cp_ring"] = _link(nodes, 2), _link(nodes, 1)  # [groups, ring, a2a]
    return out
