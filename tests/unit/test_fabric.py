"""plan/fabric.py: a fabric file's measured times, read back by `Fabric.time` (exact at the
measured points, log-log between, the α-β line beyond, busbw-scaled to other group sizes, None
where nothing was measured), the bus-bandwidth factors against nccl-tests' published ones, and
`load_fabric`'s messages for broken files."""

from __future__ import annotations

import json
import math

import pytest

from megatron_lite.parallel.comm_stats import bus_bytes
from megatron_lite.plan.fabric import FabricError, load_fabric

# NVIDIA/nccl-tests doc/PERFORMANCE.md "Summary" (busbw = algbw · factor), and src/sendrecv.cu
# (factor 1), as printed there, at n = 8
NCCL_TESTS_FACTOR_N8 = {
    "all_reduce": 2 * 7 / 8,
    "all_gather": 7 / 8,
    "reduce_scatter": 7 / 8,
    "all_to_all": 7 / 8,
    "send": 1.0,
}


def point(op: str, n: int, size: float, t: float) -> dict:
    """One entry as tools/bench_comm.py writes it (GB/s)."""
    return {
        "group": "tp",
        "n": n,
        "bytes": size,
        "time_s": t,
        "algbw": size / t / 1e9,
        "busbw": bus_bytes(op, size, n) / t / 1e9,
    }


def write(tmp_path, ops: dict, **top) -> str:
    data = {"format": "megatron_lite.fabric", "version": 1, "backend": "gloo", "world": 8}
    data.update(top)
    data["ops"] = ops
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps(data))
    return str(path)


# measured all_reduce over 4 ranks inside a node: sizes 1 KiB .. 1 MiB, times growing
SIZES = [1024 * 4**i for i in range(6)]
TIMES = [20e-6, 24e-6, 41e-6, 110e-6, 380e-6, 1.46e-3]


@pytest.fixture
def fabric(tmp_path):
    entries = [point("all_reduce", 4, s, t) for s, t in zip(SIZES, TIMES, strict=True)]
    return load_fabric(write(tmp_path, {"all_reduce": {"intra": entries}}))


@pytest.mark.parametrize("op", list(NCCL_TESTS_FACTOR_N8))
def test_bus_factor_is_nccl_tests(op):
    """busbw / algbw = bus_bytes / S: nccl-tests' published factor (n = 8)."""
    assert bus_bytes(op, 1 << 20, 8) / (1 << 20) == pytest.approx(NCCL_TESTS_FACTOR_N8[op], 1e-15)


def test_exact_at_measured_points(fabric):
    got = [fabric.time("all_reduce", s, 4, "intra") for s in SIZES]
    assert got == TIMES, got


def test_log_log_between_points_and_monotone(fabric):
    """At the geometric mean of two measured sizes: the geometric mean of their times (a power
    law between them); over a fine sweep the times never decrease (the measured ones grow)."""
    for k in range(len(SIZES) - 1):
        (s0, s1), (t0, t1) = SIZES[k : k + 2], TIMES[k : k + 2]
        mid = fabric.time("all_reduce", math.sqrt(s0 * s1), 4, "intra")
        assert mid == pytest.approx(math.sqrt(t0 * t1), rel=1e-12)
    sweep = [SIZES[0] * 1.01**k for k in range(int(math.log(SIZES[-1] / SIZES[0], 1.01)) + 1)]
    times = [fabric.time("all_reduce", s, 4, "intra") for s in sweep]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))


def test_below_range_is_the_smallest_sizes_latency(fabric):
    assert fabric.time("all_reduce", 8, 4, "intra") == TIMES[0]


def test_above_range_follows_an_alpha_beta_fabric_exactly(tmp_path):
    """Times measured on t = α + bus_bytes / B: the extrapolation is that line."""
    alpha, bw = 15e-6, 12e9  # 15 us, 12 GB/s bus bandwidth
    exact = lambda s: alpha + bus_bytes("reduce_scatter", s, 4) / bw  # noqa: E731
    entries = [point("reduce_scatter", 4, s, exact(s)) for s in SIZES]
    fab = load_fabric(write(tmp_path, {"reduce_scatter": {"inter": entries}}))
    for size in (SIZES[-1] * 3, 1 << 30, 70e9):
        assert fab.time("reduce_scatter", size, 4, "inter") == pytest.approx(exact(size), 1e-12)


def test_other_group_size_scales_by_the_bus_factor(tmp_path):
    """Measured at n = 2 and n = 8: n = 8 reads its own; n = 3 the nearer n = 2, n = 4 (a tie in
    ratio) the larger, n = 16 n = 8's, each times the ratio of bus bytes; send does not scale."""
    pairs = list(zip(SIZES, TIMES, strict=True))
    ar = [point("all_reduce", n, s, t * n) for n in (2, 8) for s, t in pairs]
    sends = [point("send", 2, s, t) for s, t in pairs]
    fab = load_fabric(write(tmp_path, {"all_reduce": {"intra": ar}, "send": {"intra": sends}}))
    s, t = SIZES[2], TIMES[2]
    factor = lambda n: 2 * (n - 1) / n  # noqa: E731 (nccl-tests' all-reduce factor)
    assert fab.time("all_reduce", s, 8, "intra") == pytest.approx(t * 8, 1e-12)
    assert fab.time("all_reduce", s, 3, "intra") == pytest.approx(t * 2 * factor(3) / factor(2))
    assert fab.time("all_reduce", s, 4, "intra") == pytest.approx(t * 8 * factor(4) / factor(8))
    assert fab.time("all_reduce", s, 16, "intra") == pytest.approx(t * 8 * factor(16) / factor(8))
    assert fab.time("send", s, 2, "intra") == fab.time("send", s, 7, "intra") == t


def test_none_where_not_measured_and_zero_where_nothing_moves(fabric):
    assert fabric.time("all_reduce", 4096, 4, "inter") is None
    assert fabric.time("all_gather", 4096, 4, "intra") is None
    assert fabric.time("all_reduce", 4096, 1, "intra") == 0.0
    assert fabric.measured() == [("all_reduce", "intra", 4)]
    assert fabric.time("broadcast", 4096, 4, "intra") is None  # the planner's, never measured
    with pytest.raises(ValueError, match="scope"):
        fabric.time("all_reduce", 4096, 4, "nvlink")
    with pytest.raises(ValueError, match="unknown op 'allreduce'"):
        fabric.time("allreduce", 4096, 4, "intra")


def test_two_groups_of_one_size_and_scope_keep_the_slower(tmp_path):
    slow = point("all_gather", 2, 4096, 90e-6) | {"group": "dp"}
    fast = point("all_gather", 2, 4096, 30e-6)
    fab = load_fabric(write(tmp_path, {"all_gather": {"intra": [fast, slow]}}))
    assert fab.time("all_gather", 4096, 2, "intra") == 90e-6


GOOD = point("all_reduce", 2, 4096, 1e-4)
BROKEN = {  # what is wrong -> (the file's ops, or top-level fields, and words the error names)
    "missing time_s": (
        {"all_reduce": {"intra": [{k: v for k, v in GOOD.items() if k != "time_s"}]}},
        {},
        "ops.all_reduce.intra[0].time_s",
    ),  # fmt: skip
    "busbw in B/s": (
        {"all_reduce": {"intra": [GOOD | {"busbw": GOOD["busbw"] * 1e9}]}},
        {},
        "ops.all_reduce.intra[0].busbw",
    ),  # fmt: skip
    "unknown op": ({"allreduce": {"intra": [GOOD]}}, {}, "ops.allreduce is not an op"),
    "unknown scope": (
        {"all_reduce": {"nvlink": [GOOD]}},
        {},
        "ops.all_reduce.nvlink is not a scope",
    ),  # fmt: skip
    "n of one": ({"all_reduce": {"intra": [GOOD | {"n": 1}]}}, {}, "ops.all_reduce.intra[0].n=1"),
    "negative time": ({"all_reduce": {"intra": [GOOD | {"time_s": -1.0}]}}, {}, "time_s=-1.0"),
    "version": ({}, {"version": 2}, "version=2"),
    "world": ({}, {"world": "8"}, "world='8'"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_file_names_the_file_the_field_and_the_fix(tmp_path, case):
    ops, top, words = BROKEN[case]
    path = write(tmp_path, ops, **top)
    with pytest.raises(FabricError) as e:
        load_fabric(path)
    assert path in str(e.value) and words in str(e.value) and "Fix:" in str(e.value), str(e.value)


def test_unreadable_or_not_json(tmp_path):
    with pytest.raises(FabricError, match="cannot read it.*Fix: rerun tools/bench_comm.py"):
        load_fabric(str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": ')
    with pytest.raises(FabricError, match="not JSON \\(line 1"):
        load_fabric(str(bad))


def _step_seconds(capsys, argv) -> tuple[float, float]:
    """`plan`'s predicted (step time, TP exposed seconds), from its "step time" line."""
    from megatron_lite.plan.__main__ import main

    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step time "))
    return float(line.split()[2]), float(line.split("tp exposed ")[1].split(",")[0])


def test_plan_fabric_replaces_the_model_s_tp_time(tmp_path, capsys):
    # the quickstart's TP all-gathers and reduce-scatters (48 + 32 per step on the busiest
    # rank, inside a node): a fabric that measured them at 1 ms each at every size makes TP's
    # exposed time 80 x 1 ms (the model's NVLink figure is about 1 ms for all of them) and the
    # step longer; a file without those ops changes nothing (Fabric.time None: the model's)
    sizes = [2**10, 2**24]
    slow = {
        op: {"intra": [point(op, 2, s, 1e-3) for s in sizes]}
        for op in ("all_gather", "reduce_scatter")
    }
    other = {"all_to_all": {"inter": [point("all_to_all", 2, s, 1e-3) for s in sizes]}}
    base = ["--config", "configs/quickstart.yaml", "--gpu", "h100"]
    plain = _step_seconds(capsys, base)
    measured = _step_seconds(capsys, [*base, "--fabric", write(tmp_path, slow)])
    (tmp_path / "other").mkdir()
    unused = _step_seconds(capsys, [*base, "--fabric", write(tmp_path / "other", other)])
    assert unused == plain
    assert measured[1] == pytest.approx(0.080, abs=5e-4), measured
    assert plain[1] < 0.002 and measured[0] > plain[0] + 0.078, (plain, measured)


def test_plan_fabric_bad_file_names_the_flag(tmp_path, capsys):
    from megatron_lite.plan.__main__ import main

    bad = tmp_path / "fabric.json"
    bad.write_text("{}")
    assert main(["--config", "configs/quickstart.yaml", "--fabric", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--fabric" in err and str(bad) in err, err
