"""tools/bench_resilience.py: its figures from made-up step times (fast), and the tool on 2
spawned ranks (slow)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_resilience  # noqa: E402


def test_figures_pair_adjacent_steps_and_divide_the_bookkeeping_by_the_off_step():
    # rank 0: off steps 1.0, 2.0 s (a drift), on steps 1.01, 2.02: +1% per pair, while the
    # medians of the two sets differ by 1%; rank 1 the same; bookkeeping 0.001 s a step
    rank = ([1.0, 2.0], [1.01, 2.02], [0.001, 0.001])
    figures, lines = bench_resilience.summarize([rank, rank], budget=0.02)
    assert figures["ab"] == pytest.approx(0.01, abs=1e-12)
    assert figures["off_s"] == 1.5  # the median of 1, 2, 1, 2
    assert figures["direct"] == pytest.approx(0.001 / 1.5, abs=1e-12)
    assert lines[-1] == "budget 2%: ok"
    over = ([1.0], [1.05], [0.0])
    assert bench_resilience.summarize([over], budget=0.02)[1][-1] == "budget 2%: OVER"


@pytest.mark.slow
def test_bench_runs_on_two_ranks():
    cmd = [sys.executable, "tools/bench_resilience.py", "--world", "2", "--steps", "4"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "A/B overhead" in out.stdout and "bookkeeping" in out.stdout, out.stdout
