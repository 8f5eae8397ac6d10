"""tools/bench_pipeline.py end to end on a tiny model: our schedules and PyTorch's
(torch.distributed.pipelining) train the same model on the same data to the same losses, our
ZB-V and DualPipeV tables are PyTorch's action for action, and the table, CSV, JSON and
timeline come out. The ranks fork from the suite's forkserver
(tests/dist_harness.py) instead of the tool's spawned interpreters: the same code, without a
torch import per rank."""

import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torch_actions(order: list[str], pp: int) -> list:
    """PyTorch's printed actions of one rank ('3F0': stage 3, forward, microbatch 0; I: input
    backward; W: weight; B: both; '(0F3;3B1)OVERLAP_F_B': the two in turn) as our Actions."""
    import re

    from megatron_lite.pipeline.schedules import Action, stage_location

    kinds = {"F": ["forward"], "I": ["backward"], "W": ["weight"], "B": ["backward", "weight"]}
    out = []
    for item in order:
        for stage, kind, mb in re.findall(r"(\d+)([FIWB])(\d+)", item):
            chunk = stage_location(int(stage), pp, "v")[1]
            out += [Action(k, int(mb), chunk) for k in kinds[kind]]
    return out


@pytest.mark.slow  # the suite's budget: CI's slow tier runs it
def test_quick_run_writes_every_output_and_pytorch_agrees(tmp_path, monkeypatch, capsys):
    import tools.bench_context_parallel
    from megatron_lite.pipeline.schedules import get_schedule
    from tests.dist_harness import run_ranks
    from tools import bench_pipeline

    def forked(world, fn, *args, timeout=900):
        return run_ranks(world, fn, *args, timeout=timeout)[0]

    monkeypatch.setattr(tools.bench_context_parallel, "spawn", forked)
    names = ["1f1b", "zb-h1", "zb-v", "dualpipev", "torch-zbv", "torch-dualpipev"]
    args = ["--pp", "2", "-m", "4", "--layers", "4", "--hidden", "32", "--seq", "16",
            "--steps", "2", "--repeats", "1", "--schedules", ",".join(names),
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert bench_pipeline.main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["schedule"] for r in results] == names
    by = {r["schedule"]: r for r in results}
    assert by["zb-h1"]["costs_ms"]["weight"] > 0 and by["1f1b"]["costs_ms"]["weight"] == 0
    assert by["torch-zbv"]["costs_ms"]["weight"] > 0  # PyTorch's W passes were timed
    ref = by["1f1b"]["losses"]
    for r in results:  # the same model and data: every schedule trains the same losses
        for a, b in zip(r["losses"], ref, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (r["schedule"], r["losses"], ref)
        assert r["simulated_bubble"] is not None or r["implementation"] == "pytorch", r
    # our zb-v and dualpipev tables are PyTorch's, action for action (its B: our B then W)
    for ours, theirs in (("zb-v", "torch-zbv"), ("dualpipev", "torch-dualpipev")):
        for rank, order in enumerate(by[theirs]["pipeline_order"]):
            computes = [a for a in get_schedule(2, rank, 4, 2, ours) if not a.is_comm]
            assert computes == torch_actions(order, 2), (ours, rank, order)
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["schedule"] for r in rows] == names
    assert (tmp_path / "timeline.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "torch-zbv" in out and "bubble" in out


def test_unknown_schedule_is_refused():
    run = subprocess.run([sys.executable, "tools/bench_pipeline.py", "--schedules", "gpipe"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "--schedules 'gpipe'" in run.stderr
