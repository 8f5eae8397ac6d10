"""Collective cost model: which links a group crosses (`group_links`, from the rank grid), the
bus bandwidth those links give it (`bus_gbps`), and the seconds of a collective by NCCL's
algorithms on them (plan/nccl.py: ring, tree, NVLS; the fastest, as NCCL's tuner picks), or
the measured seconds of a fabric file where the node carries one.

Bandwidth a group gets (per rank, per direction, GB/s), all groups of one kind running at once
(they are translates of each other in the rank grid):
- inside a node: the node's link (NVLink, PCIe peer-to-peer, or PCIe staged through host
  memory); PCIe traffic that leaves a PCIe switch shares its uplink among the GPUs behind it
  (all of it without peer-to-peer, an all-to-all's with it; a ring crosses each uplink once);
- across nodes: a group with k ranks in each node shares the node's NICs with the
  gpus_per_node/k other groups of its kind, so its ring gets k/gpus_per_node of them (a ring
  crosses each node boundary once per channel, NCCL spreading channels over the NICs), and
  no more than the intra-node link where k > 1. Send and all-to-all across nodes: each GPU
  its share of the NICs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from megatron_lite.parallel.mesh import RankLayout
from megatron_lite.plan import nccl
from megatron_lite.plan.hardware import Node, as_node


class Link(NamedTuple):
    """How a group of a kind sits on the nodes: scope 'intra' (one node) or 'inter', its
    ranks per node (k) and the nodes it spans, for the worst group of the kind."""

    scope: str
    per_node: int
    nodes: int


def _as_link(link, n: int) -> Link:
    if isinstance(link, Link):
        return link
    if link in ("nvlink", "intra"):  # the earlier names: one node / one rank per node
        return Link("intra", n, 1)
    return Link("inter", 1, n)


def bus_gbps(op: str, link: Link, node: Node) -> float:
    """GB/s per rank per direction the group's collective runs at (module docstring)."""
    intra = node.intra_gbps
    if node.interconnect == "pcie" or (node.interconnect == "pcie-p2p" and op == "all_to_all"):
        intra /= node.gpus_per_switch
    if link.scope == "intra":
        return intra
    share = node.nic_share_gbps
    if op in ("send", "all_to_all"):
        return share
    net = share * link.per_node
    return min(intra, net) if link.per_node > 1 else net


@functools.lru_cache(maxsize=8192)
def algorithms(op: str, n: int, link: Link, node: Node) -> dict[str, tuple[float, float]]:
    """{algorithm: (latency s, algorithm bandwidth B/s)} NCCL can run `op` with over n ranks
    placed as `link` on `node` (cached: the search asks the same groups for every layout)."""
    bw = bus_gbps(op, link, node) * 1e9
    hw = "nvlink" if node.interconnect == "nvlink" else "pcie"
    nodes = link.nodes if link.scope == "inter" else 1
    if op in ("send", "all_to_all"):
        return {"p2p": nccl.point_to_point(op, n, nodes, bw, hw)}
    out = {"ring": nccl.ring(op, n, nodes, bw, hw)}
    if op == "all_reduce":
        out["tree"] = nccl.tree(n, nodes, bw, hw)
        if node.nvls and nodes == 1:
            out["nvls"] = nccl.nvls(bw)
    return out


def choose(op: str, size_bytes: float, n: int, link, hw) -> tuple[str, float]:
    """(algorithm, seconds) of the modelled collective: the fastest of NCCL's options."""
    node = as_node(hw, 8)
    link = _as_link(link, n)
    return nccl.fastest(algorithms(op, n, link, node), size_bytes)


def collective_time(op: str, size_bytes: float, n: int, link, hw, fabric=None) -> float:
    """Seconds of `op` over n ranks placed as `link` (a Link; 'nvlink'/'ib' for one node / one
    rank per node) on `hw` (a Node; a GPU: its usual node of 8): a fabric's measured time
    where it has one (`fabric`, else the node's: `time(op, size_bytes, n, scope)`), else the
    fastest algorithm of NCCL's model. `size_bytes` as comm_stats.bus_bytes takes it."""
    if n <= 1 and op != "send":
        return 0.0
    node = as_node(hw, 8)
    link = _as_link(link, n)
    fabric = fabric if fabric is not None else node.fabric
    if fabric is not None:
        measured = fabric.time(op, size_bytes, n, link.scope)
        if measured is not None:
            return float(measured)
    options = algorithms(op, n, link, node)
    if len(options) == 1:
        lat, bw = next(iter(options.values()))
        return lat + size_bytes / bw
    return nccl.fastest(options, size_bytes)[1]


def _link(nodes) -> Link:
    """The Link of the worst group in a node-number array [groups, size]: the most nodes."""
    size = nodes.shape[-1]
    s = np.sort(nodes.reshape(-1, size), axis=1)
    spanned = int((1 + (s[:, 1:] != s[:, :-1]).sum(axis=1)).max()) if size > 1 else 1
    if spanned == 1:
        return Link("intra", size, 1)
    return Link("inter", max(size // spanned, 1), spanned)


@functools.lru_cache(maxsize=4096)
def group_links(
    world: int, tp: int, pp: int, cp: int, ep: int, order: str, gpus_per_node: int,
    cp_a2a: int | None = None, dp_shard: int | None = None,
) -> dict[str, Link]:  # fmt: skip
    """{group name: Link}: how the groups of each kind sit on nodes, from the rank grid of
    `parallel.order` (mesh.RankLayout, the one owner of the rank order). Groups of one kind
    are translates of each other, so the worst one is taken. `cp_a2a` ranks of each CP group
    run Ulysses together (None: all of them) and the ring spans the rest: CP rank = ring rank
    · cp_a2a + a2a rank (mesh.py), so the a2a groups are consecutive CP ranks (with the
    default order inside one node first: the hybrid's point) and the ring strides them.
    `dp_shard` (hybrid sharding): the shard groups are consecutive blocks of the dp_cp / edp
    group, the replica groups stride them (ddp.hybrid_groups): dp_shard, dp_replica,
    edp_shard, edp_replica."""
    layout = RankLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order, cp_a2a=cp_a2a)
    out = {}
    for name in ("tp", "cp", "dp_cp", "ep", "edp", "pp"):
        out[name] = _link(layout.group_array(name) // gpus_per_node)  # [groups, size]
    a2a = layout.a2a
    nodes = layout.group_array("cp").reshape(-1, cp // a2a, a2a) // gpus_per_node
    out["cp_a2a"] = _link(nodes)  # [groups, ring, a2a]: a2a groups along the last axis
    out["cp_ring"] = _link(nodes.transpose(0, 2, 1))
    for name in ("dp_cp", "edp"):
        full = layout.group_array(name) // gpus_per_node
        shard = dp_shard if dp_shard and full.shape[1] % dp_shard == 0 else full.shape[1]
        blocks = full.reshape(full.shape[0], -1, shard)  # [groups, replicas, shard]
        out[f"{name}_shard"] = _link(blocks)
        out[f"{name}_replica"] = _link(blocks.transpose(0, 2, 1))
    return out
