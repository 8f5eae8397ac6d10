"""The planner on every context-parallel type (parallel.cp_comm_type a2a, p2p, a2a+p2p): the
activation bytes per rank fall as 1/cp at a fixed total sequence (Ulysses' KV replication
aside), the links of the Ulysses and ring groups follow the
rank grid, and the search runs the ring where Ulysses cannot split the heads. Measured
figures (SavedTensorMeter, dry run) are tests/parallel/test_plan_measure.py's and
tests/unit/test_dry_run_planner.py's."""

import pytest

from megatron_lite.config import load_config
from megatron_lite.plan.comm import Link, group_links
from megatron_lite.plan.search import apply, layouts
from megatron_lite.validation import validate
from tests.plan_reference import LayerShape, layer_terms

# s = 8192 at a tiny width; g = n KV heads, so Ulysses replicates none up to cp <= 8
SHAPE = dict(arch="llama", s=8192, b=1, h=128, n=8, g=8, f=256)
TYPES = {"a2a": lambda cp: 1, "p2p": lambda cp: cp, "a2a+p2p": lambda cp: max(cp // 2, 1)}


@pytest.mark.parametrize("cp_type", TYPES)
@pytest.mark.parametrize("act_bytes", [2, 4])
def test_activations_per_rank_fall_as_one_over_cp(cp_type, act_bytes):
    def saved(cp: int) -> float:
        x = LayerShape(**SHAPE, cp=cp, ring=TYPES[cp_type](cp), act_bytes=act_bytes)
        return sum(layer_terms(x).values())

    # Ulysses from cp = 1; the ring from cp = 2, where its fp32 accumulator (and, in bf16,
    # the output's copy) replace flash's output: 1/cp from there on
    ref, at = (saved(1), 1) if cp_type == "a2a" else (saved(2), 2)
    for cp in (2, 4, 8):
        got = saved(cp)
        assert got * cp == pytest.approx(ref * at, rel=0.1), f"{cp_type} cp={cp}: {got}, {ref}"


def test_hybrid_links_keep_ulysses_inside_a_node_and_the_ring_across():
    order = "tp-cp-ep-dp-pp"
    hybrid = group_links(64, 1, 1, 16, 1, order, 8, 8)  # 2 nodes: a2a over 8, ring of 2
    # Link(scope, ranks per node, nodes): the ring's 2 ranks on 2 nodes, CP's 16 on 8 + 8
    assert hybrid["cp_a2a"] == Link("intra", 8, 1)
    assert (hybrid["cp_ring"], hybrid["cp"]) == (Link("inter", 1, 2), Link("inter", 8, 2))
    ulysses = group_links(64, 1, 1, 16, 1, order, 8)
    assert (ulysses["cp_a2a"], ulysses["cp_ring"]) == (Link("inter", 8, 2), Link("intra", 1, 1))
    ring = group_links(64, 2, 1, 4, 1, order, 8, 1)  # tp2 cp4 fill one node
    assert (ring["cp_a2a"].scope, ring["cp_ring"]) == ("intra", Link("intra", 4, 1))


def test_search_runs_the_ring_where_ulysses_cannot_split_the_heads():
    cfg = load_config(None, [
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.seq_length=64",
        "model.vocab_size=256", "data.mock=true", "train.global_batch_size=8",
    ])  # fmt: skip
    first = {}
    for o in layouts(cfg, 8, 8):
        first.setdefault((o["parallel.tp"], o["parallel.cp"]), o)
    assert "parallel.cp_comm_type" not in first[(1, 4)]  # 4 heads over cp 4: Ulysses
    for tp, cp in ((1, 8), (2, 4)):  # 4/tp query heads not divisible by cp
        o = first[(tp, cp)]
        assert o["parallel.cp_comm_type"] == "p2p", (tp, cp)
        validate(apply(cfg, o), 8)  # and the ring is a valid layout there
