"""The planner's communication model against NCCL's published formulas: NCCL-tests' bus
bandwidth (all-reduce busbw = algbw·2(n−1)/n, all-gather / reduce-scatter (n−1)/n), the tree's
latency growing with log2 of the node count, the ring/tree choice flipping where the two
formulas cross (the crossing computed here from the formulas, not from the planner), NVLS
where it applies, the links' bandwidth by topology, and a fabric's measured times replacing
the model's."""

import math

import pytest

from megatron_lite.plan.comm import Link, algorithms, bus_gbps, choose, collective_time
from megatron_lite.plan.hardware import GPUS, make_node

# NCCL 2.19 src/graph/tuning.cc, Simple protocol (µs): baseLat ring 8.4, tree 0; hwLat ring
# NVLink 3.4, PCIe 5.7, network 14; tree 28 (NVLink, PCIe and network alike)
BASE_RING, LAT_RING_NVL, LAT_RING_PCI, LAT_RING_NET, LAT_TREE = 8.4e-6, 3.4e-6, 5.7e-6, 14e-6, 28e-6
H100 = make_node(GPUS["h100"], 8)


def test_ring_inside_a_node_is_the_busbw_formula():
    """One node of 8 A100 (NVLink 300 GB/s, no NVLS): time = latency + size / algbw, algbw =
    busbw / (2(n−1)/n) for an all-reduce and busbw / ((n−1)/n) for all-gather and
    reduce-scatter; busbw = the link."""
    n, size, busbw = 8, 64e6, 300e9
    a100, intra = make_node(GPUS["a100"], 8), Link("intra", n, 1)
    ring_ar = BASE_RING + 2 * (n - 1) * LAT_RING_NVL + size / (busbw / (2 * (n - 1) / n))
    algo, t = choose("all_reduce", size, n, intra, a100)
    assert algo == "ring" and t == pytest.approx(ring_ar, rel=1e-12)
    for op in ("all_gather", "reduce_scatter"):
        want = BASE_RING + (n - 1) * LAT_RING_NVL + size / (busbw / ((n - 1) / n))
        assert collective_time(op, size, n, intra, a100) == pytest.approx(want, rel=1e-12)


def test_nvls_takes_large_all_reduces_on_nvswitch_nodes_only():
    """NVLS (algbw 5/6 of busbw, 23 µs) beats the ring (algbw busbw·8/14) for large messages
    on an NVSwitch node; the A100 (no NVLink SHARP) and PCIe nodes have only ring and tree."""
    size, intra = 1e9, Link("intra", 8, 1)
    assert choose("all_reduce", size, 8, intra, H100) == (
        "nvls",
        pytest.approx(23e-6 + size / (450e9 * 5 / 6)),
    )
    assert choose("all_reduce", size, 8, intra, make_node(GPUS["a100"], 8))[0] == "ring"
    assert choose("all_reduce", size, 8, intra, make_node(GPUS["l40s"], 8))[0] == "ring"


def _tree_latency(per_node: int, nodes: int) -> float:
    return 2 * ((per_node - 1) * LAT_TREE + math.floor(math.log2(nodes)) * LAT_TREE)


def test_tree_latency_grows_with_log2_of_the_nodes_and_the_ring_with_n():
    """A tiny all-reduce over k nodes of 1 GPU each (the bandwidth term negligible): the tree's
    time grows by 2·28 µs per doubling of nodes, the ring's by 2·14 µs per node."""
    node = make_node(GPUS["h100"], 8)
    tiny = 1.0
    tree, ring = {}, {}
    for k in (2, 4, 8, 16, 32):
        link = Link("inter", 1, k)
        opts = algorithms("all_reduce", k, link, node)
        tree[k], ring[k] = opts["tree"][0], opts["ring"][0]
        assert tree[k] == pytest.approx(_tree_latency(1, k), rel=1e-12)
        # tuning.cc: (2(n−1) − 2N) intra steps (−2 here) and 2N network steps
        want = BASE_RING + (2 * (k - 1) - 2 * k) * LAT_RING_NVL + 2 * k * LAT_RING_NET
        assert ring[k] == pytest.approx(want, rel=1e-12)
        assert collective_time("all_reduce", tiny, k, link, node) == pytest.approx(
            min(tree[k], ring[k]), rel=1e-6
        )
    assert [tree[2 * k] - tree[k] for k in (2, 4, 8, 16)] == pytest.approx([56e-6] * 4)


@pytest.mark.parametrize("nodes", [8, 16, 64])
def test_the_choice_flips_where_ring_and_tree_cross(nodes):
    """Across `nodes` nodes of 8 H100 (all 8 of a node in the group: busbw = the node's 8 NICs
    at 90% of 400 Gb/s = 360 GB/s, below NVLink's 450): ring latency 8.4 + (2(n−1) − 2N)·3.4
    + 2N·14 µs, algbw busbw·n/(2(n−1)); tree latency 2·(7·28 + log2 N·28) µs, algbw
    0.92·busbw/2. Below the size where they cross the tree is faster, above it the ring."""
    n, busbw = 8 * nodes, min(450e9, 8 * 400e9 / 8 * 0.9)
    ring = (BASE_RING + (2 * (n - 1) - 2 * nodes) * LAT_RING_NVL + 2 * nodes * LAT_RING_NET,
            busbw * n / (2 * (n - 1)))  # fmt: skip
    tree = (_tree_latency(8, nodes), 0.92 * busbw / 2)
    cross = (tree[0] - ring[0]) / (1 / ring[1] - 1 / tree[1])
    assert cross > 0  # the tree's latency is lower, its bandwidth lower: they cross
    link = Link("inter", 8, nodes)
    assert choose("all_reduce", 0.98 * cross, n, link, H100)[0] == "tree"
    assert choose("all_reduce", 1.02 * cross, n, link, H100)[0] == "ring"


def test_bus_bandwidth_by_topology():
    """Inside a node: NVLink's link, PCIe P2P's 50 GB/s (Gen5 x16), half that staged through
    host memory and shared by the GPUs behind one switch; across nodes: a group with k ranks
    per node gets k of the node's 8 shares of its NICs, at most the intra-node link."""
    intra, one, four = Link("intra", 8, 1), Link("inter", 1, 2), Link("inter", 4, 2)
    assert bus_gbps("all_reduce", intra, H100) == 450
    p2p = make_node(GPUS["rtx-pro-6000"], 8, gpus_per_switch=2)
    assert bus_gbps("all_reduce", intra, p2p) == 50  # a ring crosses each uplink once
    assert bus_gbps("all_to_all", intra, p2p) == 25
    host = make_node(GPUS["rtx5090"], 8, gpus_per_switch=2)
    assert bus_gbps("all_reduce", intra, host) == 50 * 0.5 / 2
    ib = make_node(GPUS["rtx-pro-6000"], 8, nic_gbps=200, nics=1, nic_type="ib")
    share = 200 / 8 * 0.9 / 8  # one 200 Gb/s NIC at 90% over 8 GPUs
    assert bus_gbps("all_reduce", one, ib) == pytest.approx(share)
    assert bus_gbps("all_reduce", four, ib) == pytest.approx(4 * share)
    roce = make_node(GPUS["rtx-pro-6000"], 8, nic_gbps=100, nics=1, nic_type="roce")
    assert bus_gbps("send", one, roce) == pytest.approx(100 / 8 * 0.8 / 8)
    assert bus_gbps("all_reduce", four, make_node(GPUS["h100"], 8)) == pytest.approx(4 * 45)


class FakeFabric:
    """plan/fabric.py's shape: measured seconds for inter-node all-reduces, None otherwise."""

    def __init__(self, seconds: float):
        self.seconds, self.asked = seconds, []

    def time(self, op, size_bytes, n, scope):
        self.asked.append((op, size_bytes, n, scope))
        return self.seconds if (op, scope) == ("all_reduce", "inter") else None


def test_a_fabric_replaces_the_model_where_it_has_a_figure():
    fabric = FakeFabric(0.125)
    node = make_node(GPUS["h100"], 8, fabric=fabric)
    inter, intra = Link("inter", 1, 2), Link("intra", 8, 1)
    assert collective_time("all_reduce", 1e9, 2, inter, node) == 0.125
    assert fabric.asked == [("all_reduce", 1e9, 2, "inter")]
    modelled = collective_time("all_gather", 1e9, 8, intra, H100)
    assert collective_time("all_gather", 1e9, 8, intra, node) == modelled  # None: the model
    # an explicit fabric wins over the node's, and the node without one is the model
    assert collective_time("all_reduce", 1e9, 2, inter, H100, fabric=FakeFabric(2.0)) == 2.0
    assert collective_time("all_reduce", 1e9, 2, inter, H100) != 0.125
