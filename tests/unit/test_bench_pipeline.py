"""tools/bench_pipeline.py end to end on a tiny model: both schedules train the same losses and
the table, CSV, JSON and timeline come out."""

import csv
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_writes_every_output(tmp_path):
    args = ["--pp", "2", "-m", "4", "--layers", "2", "--hidden", "32", "--seq", "16",
            "--steps", "2", "--repeats", "1", "--out-dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run([sys.executable, "tools/bench_pipeline.py", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["schedule"] for r in results] == ["1f1b", "zb-h1"]
    one, zb = results
    assert zb["costs_ms"]["weight"] > 0 and one["costs_ms"]["weight"] == 0
    for a, b in zip(one["losses"], zb["losses"], strict=True):  # the same model and data
        assert abs(a - b) <= 1e-5 * abs(a), (one["losses"], zb["losses"])
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["schedule"] for r in rows] == ["1f1b", "zb-h1"]
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert "zb-h1" in run.stdout and "bubble" in run.stdout


def test_unknown_schedule_is_refused():
    run = subprocess.run([sys.executable, "tools/bench_pipeline.py", "--schedules", "gpipe"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "--schedules 'gpipe'" in run.stderr
