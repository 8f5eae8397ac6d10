"""tools/bench_comm.py on 2 and 4 gloo ranks: it measures every op on the layout's groups, with
each group's scope from --gpus-per-node, nccl-tests' sizes and bus-bandwidth factors, and
writes a file that plan/fabric.py's `load_fabric` reads back point for point."""

from __future__ import annotations

import pytest

from megatron_lite.plan.fabric import OPS, load_fabric
from tests.dist_harness import run_ranks
from tools.bench_comm import main, parse_size, report

# tiny sizes and few iterations: the test checks what is measured and written, not the speed
QUICK = ["--min-bytes", "1K", "--max-bytes", "2K", "--warmup", "1", "--iters", "2"]


def nccl_tests_factor(op: str, n: int) -> float:
    """busbw / algbw as NVIDIA/nccl-tests doc/PERFORMANCE.md's Summary prints it (and
    src/sendrecv.cu: 1)."""
    return {"all_reduce": 2 * (n - 1) / n, "send": 1.0}.get(op, (n - 1) / n)


def _bench(rank: int, world: int, argv: list[str], gpus_per_node: int):
    from tools.bench_comm import measure, parse_args

    return measure(parse_args(argv), gpus_per_node)


def check_points(fabric: dict, path: str) -> None:
    """Every point: algbw = bytes / time, busbw / algbw = nccl-tests' factor, and Fabric.time
    gives the measured time back at its size, n and scope."""
    fab = load_fabric(path)
    for op, scopes in fabric["ops"].items():
        for scope, entries in scopes.items():
            for e in entries:
                assert e["algbw"] == pytest.approx(e["bytes"] / e["time_s"] / 1e9, rel=1e-12)
                ratio = e["busbw"] / e["algbw"]
                assert ratio == pytest.approx(nccl_tests_factor(op, e["n"]), rel=1e-12), (op, e)
                assert fab.time(op, e["bytes"], e["n"], scope) >= e["time_s"], (op, scope, e)


@pytest.mark.timeout(120)
def test_two_ranks_default_layout(tmp_path):
    """One group [0, 1] (dp; dp_cp and edp are the same ranks), inside one node: all five ops
    at 1 KiB and 2 KiB."""
    fabric = run_ranks(2, _bench, QUICK, 2, timeout=100)[0]
    path = str(tmp_path / "fabric.json")
    report(fabric, path)
    assert fabric["backend"] == "gloo" and fabric["world"] == 2
    assert fabric["groups"] == {
        "dp": {"aliases": ["dp_cp", "edp"], "ranks": [[0, 1]], "scopes": ["intra"]}
    }
    assert sorted(fabric["ops"]) == sorted(OPS)
    for op in OPS:
        assert [(e["group"], e["n"], e["bytes"]) for e in fabric["ops"][op]["intra"]] == [
            ("dp", 2, 1024),
            ("dp", 2, 2048),
        ], op
    check_points(fabric, path)
    assert load_fabric(path).measured() == sorted((op, "intra", 2) for op in OPS)


@pytest.mark.timeout(180)
def test_four_ranks_hybrid_groups_and_scopes(tmp_path):
    """dp=4 with parallel.dp_shard=2 on "nodes" of 3 ranks (0-2 and 3): dp [0..3] spans nodes;
    of the shard groups [0, 1] is inside node 0 and [2, 3] spans both, of the replicas [0, 2]
    is inside and [1, 3] spans: scope is per group, so one kind can have both."""
    argv = [*QUICK, "--ops", "all_reduce,all_gather,send", "parallel.dp_shard=2"]
    fabric = run_ranks(4, _bench, argv, 3, timeout=160)[0]
    path = str(tmp_path / "fabric.json")
    report(fabric, path)
    groups = {k: (v["ranks"], v["scopes"]) for k, v in fabric["groups"].items()}
    assert groups == {
        "dp": ([[0, 1, 2, 3]], ["inter"]),
        "dp_cp_shard": ([[0, 1], [2, 3]], ["inter", "intra"]),
        "dp_cp_replica": ([[0, 2], [1, 3]], ["inter", "intra"]),
    }
    ar = fabric["ops"]["all_reduce"]
    assert [(e["group"], e["n"]) for e in ar["intra"]] == [
        *[("dp_cp_shard", 2)] * 2, *[("dp_cp_replica", 2)] * 2,
    ]  # fmt: skip
    assert [(e["group"], e["n"]) for e in ar["inter"]] == [
        *[("dp", 4)] * 2, *[("dp_cp_shard", 2)] * 2, *[("dp_cp_replica", 2)] * 2,
    ]  # fmt: skip
    check_points(fabric, path)


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("64K", 65536), ("4M", 4 << 20)])
def test_sizes_are_nccl_tests_suffixes(text, value):
    assert parse_size(text) == value


def test_a_bad_layout_is_one_message_before_any_rank_starts():
    with pytest.raises(SystemExit, match="world size 3 is not divisible by tp·pp·cp = 2"):
        main(["--world", "3", "parallel.tp=2", *QUICK])


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--groups", "tp,mp"], "--groups: ['mp'] are not group kinds"),
        (["--ops", "allreduce"], "--ops: ['allreduce'] are not ops"),
        (["--min-bytes", "4M", "--max-bytes", "1M"], "--min-bytes 4194304 > --max-bytes 1048576"),
        (["--world", "1"], "--world 1: a collective needs at least 2 ranks"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 2 and words in capsys.readouterr().err


# two fresh spawned processes import torch (~20 s on 2 busy cores): the slow tier
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_command_line_starts_its_ranks_and_writes_the_file(tmp_path):
    """`python tools/bench_comm.py --world 2 parallel.tp=2 ...`: the tool's own ranks (spawned,
    gloo over a FileStore) measure the tp group and rank 0 writes a file load_fabric reads."""
    out = str(tmp_path / "fabric.json")
    argv = ["--world", "2", "parallel.tp=2", "--ops", "all_reduce", *QUICK, "--out", out]
    assert main(argv) == 0
    fab = load_fabric(out)
    assert fab.measured() == [("all_reduce", "intra", 2)]
    assert fab.meta["layout"]["tp"] == 2 and list(fab.meta["groups"]) == ["tp"]
