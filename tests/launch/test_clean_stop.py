"""A clean stop through the launcher: SIGTERM or SIGINT (Ctrl-C) makes every rank save a
checkpoint at the step boundary and exit; torchrun and the launcher exit 0 with no traceback,
and the same command resumes from that checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.parallel.parity import TINY, structured_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(out_dir, steps):
    data = f"data.paths=[{structured_dataset()}]"
    args = [*TINY, data, "parallel.dp=2", f"train.steps={steps}", "train.save_interval=1000"]
    cmd = [sys.executable, "-m", "megatron_lite.launch", *args, f"train.out_dir={out_dir}"]
    env = dict(os.environ, PYTHONPATH=ROOT, MEGATRON_LITE_QUIET="1")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _steps(out_dir) -> list[int]:
    """Steps logged so far. Polled while rank 0 appends: a read can end inside the record
    being written (its last line has no newline yet), so only whole lines count."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n") and line.strip()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_resumes(tmp_path, sig):
    out = str(tmp_path / "run")
    proc = _launch(out, steps=400)
    deadline = time.monotonic() + 120
    while len(_steps(out)) < 2:  # wait until training runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
    assert f"got {sig.name}" in output and "stopping cleanly" in output, output
    done = _steps(out)
    assert 2 <= len(done) < 400 and done == list(range(len(done))), done
    saved = os.path.join(out, "checkpoints", f"step_{len(done)}")
    assert os.path.isdir(saved), os.listdir(os.path.join(out, "checkpoints"))
    if sig == signal.SIGTERM:  # the same command (fewer steps) continues from the checkpoint
        again = _launch(out, steps=len(done) + 2)
        output, _ = again.communicate(timeout=180)
        assert again.returncode == 0, output
        assert _steps(out) == list(range(len(done) + 2)), _steps(out)
