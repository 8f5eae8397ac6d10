"""NVMe optimizer offload through the real launcher: a rank killed with SIGKILL mid-run
(torchrun restarts the group, which resumes from the last checkpoint) ends with the losses of
an uninterrupted run, the killed attempt's swap directories are discarded as stale at the
restart, and the clean exit leaves the swap path empty. Checkpoints hold the states (read from
the swap files at the save), so the resume never needs the killed attempt's files."""

from __future__ import annotations

import os
import signal

import pytest

from tests.launch.test_fault_tolerance import (
    SMOKE,
    finish,
    launch,
    metric_records,
    rank_pids,
    read_metrics,
    stop,
    wait_for,
)


@pytest.mark.slow
def test_killed_rank_resumes_nvme_offload_with_the_same_losses(tmp_path):
    steps, save = 12, 4
    swap_ref, swap = tmp_path / "swap_ref", tmp_path / "swap"
    swap_ref.mkdir()
    swap.mkdir()
    common = ["--config", SMOKE, "parallel.dp=2", "parallel.zero_stage=1", f"train.steps={steps}",
              f"train.save_interval={save}", "train.resume=auto", "log.progress=false",
              "train.optimizer_offload=nvme", "train.nvme_buffer_mb=1"]  # fmt: skip
    ref_out, out = tmp_path / "reference", tmp_path / "killed"
    ref = launch([*common, f"train.out_dir={ref_out}", f"train.nvme_path={swap_ref}"],
                 tmp_path / "reference.log")  # fmt: skip
    log = tmp_path / "killed.log"
    proc = launch(["--max-restarts", "1", *common, f"train.out_dir={out}",
                   f"train.nvme_path={swap}"], log)  # fmt: skip
    pids = {}
    try:
        wait_for(lambda: len(read_metrics(out)) >= save + 2, 240, f"step {save + 2}", proc)
        pids = rank_pids(proc.pid)
        killed = sorted(os.listdir(swap))  # both ranks' swap directories, live
        os.kill(pids[1], signal.SIGKILL)
        killed_at = max(read_metrics(out))
        output = finish(proc, log, timeout=300)
        ref_output = finish(ref, tmp_path / "reference.log", timeout=300)
    finally:
        stop(proc, pids)
        stop(ref)
    assert ref.returncode == 0, ref_output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert len(killed) == 2 and all(".rank" in k for k in killed), killed
    assert killed_at < steps - 1, f"the run finished (step {killed_at}) before the kill"
    assert f"resumed from {out / 'checkpoints'}" in output, output[-3000:]
    assert [r["step"] for r in metric_records(out)] == list(range(steps))
    want, got = read_metrics(ref_out), read_metrics(out)
    diffs = {
        s: (got[s]["loss"], want[s]["loss"]) for s in want if got[s]["loss"] != want[s]["loss"]
    }
    assert not diffs, f"losses after the restart differ from the uninterrupted run: {diffs}"
    assert os.listdir(swap) == [] and os.listdir(swap_ref) == [], (os.listdir(swap), killed)
