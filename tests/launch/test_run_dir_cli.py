"""The run-directory rules through the real CLI (python -m megatron_lite.train): a second run on
a directory in use fails at once (exit 2, one paragraph naming the holder, no traceback) and the
first finishes with its checkpoints, metrics and config untouched; a crafted `.metadata` ends a
resume with exit 2 and the file's name, having run nothing."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from megatron_lite.checkpoint import files
from tests.crafted_checkpoint import craft_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")


def cli(out_dir, *overrides) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_lite.train",
        "--config",
        SMOKE,
        f"train.out_dir={out_dir}",
        "train.steps=6",
        "train.save_interval=2",
        "log.progress=false",
        *overrides,
    ]


def run(args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_one_paragraph_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0, f"more than one paragraph:\n{r.stderr}"


def test_second_run_fails_at_once_and_a_crafted_metadata_stops_resume(tmp_path):
    lock = tmp_path / "run.lock"
    first = subprocess.Popen(
        cli(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.exists(), "the first run took no lock"
        os.kill(first.pid, signal.SIGSTOP)  # it holds the directory while the second starts
        try:
            t0 = time.monotonic()
            second = run(cli(tmp_path, "train.lr=0.5"))
            took = time.monotonic() - t0
        finally:
            os.kill(first.pid, signal.SIGCONT)
        holder = f"host {socket.gethostname()}, pid {first.pid}, Slurm job none"
        assert_one_paragraph_error(second, holder)
        assert f"run directory {tmp_path} is in use by another run" in second.stderr
        assert took < 60, f"the second run took {took:.0f}s to fail"
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    ckpt = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckpt)) == ["latest", "step_4", "step_6"]
    for step in (4, 6):
        assert files.verify(str(ckpt / f"step_{step}"))["step"] == step
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(6))
    assert "lr: 0.001" in (tmp_path / "config.yaml").read_text(), "the second run wrote config"
    assert not lock.exists(), "the first run did not release its lock"
    # a crafted .metadata in the newest checkpoint (checksum matching) ends the next resume
    marker = tmp_path / "code-ran"
    file = craft_metadata(str(ckpt / "step_6"), str(marker))
    r = run(cli(tmp_path, "train.steps=8"))
    assert_one_paragraph_error(r, f"error: refused to load {file}")
    assert not marker.exists(), "code from the crafted .metadata ran"
    assert not lock.exists(), "the refused run kept its lock"
