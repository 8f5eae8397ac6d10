"""Rank grid golden tables (Megatron's tp-cp-ep-dp-pp order), no processes."""

import pytest

from megatron_lite.parallel.mesh import RankLayout


def test_tp2_dp2_pp2_golden():
    L = RankLayout(8, tp=2, pp=2)
    assert L.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert L.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert L.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert L.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert L.groups("tp_pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_all_five_axes_golden():
    L = RankLayout(16, tp=2, pp=2, cp=2, ep=2)
    assert L.dp == 2 and L.edp == 2
    assert L.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert L.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert L.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert L.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert L.groups("pp")[0] == [0, 8]
    # expert groups fold into dp×cp: ep takes the fastest part of it, edp the rest
    assert L.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert L.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]


def test_ep_spans_dp_when_cp_is_one():
    L = RankLayout(8, tp=2, ep=4)
    assert L.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert L.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert L.groups("edp") == [[0], [1], [2], [3], [4], [5], [6], [7]]


def test_pp_first_order():
    L = RankLayout(8, tp=2, pp=4, order="pp-tp-cp-ep-dp")
    assert L.groups("pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert L.groups("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    "world,kw",
    [(8, dict(tp=2, pp=2, cp=2)), (16, dict(tp=2, cp=2, ep=4)), (12, dict(tp=3, pp=2)), (1, {})],
)
def test_every_kind_partitions_the_world(world, kw):
    L = RankLayout(world, **kw)
    for name in ("tp", "cp", "dp", "pp", "dp_cp", "tp_pp", "ep", "edp"):
        ranks = sorted(r for g in L.groups(name) for r in g)
        assert ranks == list(range(world)), name
    # coordinates are unique per rank over (tp, cp, dp, pp)
    coords = {tuple(L.coords(r)[k] for k in ("tp", "cp", "dp", "pp")) for r in range(world)}
    assert len(coords) == world


def test_bad_layouts():
    with pytest.raises(ValueError, match="not divisible by tp·pp·cp"):
        RankLayout(6, tp=4)
    with pytest.raises(ValueError, match="must divide dp·cp"):
        RankLayout(4, tp=2, ep=4)
    with pytest.raises(ValueError, match="must name each"):
        RankLayout(4, order="tp-dp-pp")
    with pytest.raises(ValueError, match="cp, ep and dp must be adjacent"):
        RankLayout(4, order="tp-cp-pp-ep-dp")


def test_every_valid_order_keeps_expert_groups_inside_dp_cp():
    import itertools

    for perm in itertools.permutations(["tp", "cp", "ep", "dp", "pp"]):
        try:
            L = RankLayout(16, tp=2, cp=2, ep=2, order="-".join(perm))
        except ValueError:
            continue
        blocks = [set(g) for g in L.groups("dp_cp")]
        for name in ("ep", "edp"):
            for g in L.groups(name):
                assert any(set(g) <= b for b in blocks), (perm, name, g)


def test_rank_map_lists_every_rank():
    text = RankLayout(4, tp=2).rank_map()
    assert text.count("rank ") == 5 and "order tp-cp-ep-dp-pp" in text


@pytest.mark.parametrize(
    "layout",
    [
        RankLayout(16, tp=2, pp=2, cp=2),
        RankLayout(32, tp=2, pp=2, cp=2, ep=4, order="tp-pp-dp-ep-cp"),
        RankLayout(24, tp=3, pp=2, ep=2),
    ],
)
def test_all_coords_match_brute_force_search(layout):
    coords = layout.all_coords()
    for rank in range(layout.world_size):
        for name in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp"):
            group = next(g for g in layout.groups(name) if rank in g)
            assert coords[rank][name] == group.index(rank), (rank, name)
