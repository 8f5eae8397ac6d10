"""A clean stop through the launcher: SIGINT (Ctrl-C) or SIGTERM makes every rank save a
checkpoint at the step boundary and exit; torchrun and the launcher exit 0 with no traceback,
and the same command resumes from that checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

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


def _stop_with(sig, out, proc, after: int) -> list[int]:
    """Send `sig` once the run has logged `after` steps; the launcher must stop cleanly (exit
    0, no traceback) with a checkpoint of the last step. Returns the steps logged."""
    deadline = time.monotonic() + 120
    while len(_steps(out)) < after:  # wait until training runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
    assert f"got {sig.name}" in output and "stopping cleanly" in output, output
    done = _steps(out)
    assert after <= len(done) < 400 and done == list(range(len(done))), done
    saved = os.path.join(out, "checkpoints", f"step_{len(done)}")
    assert os.path.isdir(saved), os.listdir(os.path.join(out, "checkpoints"))
    return done


def test_signals_stop_cleanly_and_the_same_command_resumes(tmp_path):
    """Ctrl-C (SIGINT) stops the first launch; the same command resumes from its checkpoint
    and continues the step count, and SIGTERM stops that one the same way."""
    out = str(tmp_path / "run")
    first = _stop_with(signal.SIGINT, out, _launch(out, steps=400), after=2)
    again = _stop_with(signal.SIGTERM, out, _launch(out, steps=400), after=len(first) + 2)
    assert len(again) >= len(first) + 2, (first, again)
