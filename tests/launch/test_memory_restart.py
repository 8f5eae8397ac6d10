"""kill -9 of one rank with in-memory checkpoints on, through the real launcher (launch/local.sh
-> megatron_lite.launch -> torchrun --max-restarts 1): the restarted group resumes from the
in-memory step, newer than the last disk checkpoint, and every step's loss equals an
uninterrupted run's bitwise; at the clean end the copies in /dev/shm are gone. The harness is
test_fault_tolerance.py's."""

from __future__ import annotations

import os
import re
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


@pytest.mark.slow  # two torchrun launches and a restart: about a minute on 2 cores
def test_killed_rank_resumes_from_memory_with_same_losses(tmp_path):
    steps, save, every = 16, 8, 3  # disk at step 8, memory at 3, 6, 9, 12
    common = ["--config", SMOKE, "parallel.tp=2", "parallel.dp=1", f"train.steps={steps}"]
    common += [f"train.save_interval={save}", f"train.memory_checkpoint_interval={every}"]
    common += ["train.resume=auto", "log.progress=false"]
    ref_out, out = tmp_path / "reference", tmp_path / "killed"
    ref_log, log = tmp_path / "reference.log", tmp_path / "killed.log"
    ref = launch([*common, f"train.out_dir={ref_out}"], ref_log)
    proc = launch(["--max-restarts", "1", *common, f"train.out_dir={out}"], log)
    pids = {}
    try:
        # the copy of step 9 is written before record 8 is logged: newer than disk's step 8
        wait_for(lambda: len(read_metrics(out)) >= 10, 240, "step 9", proc)
        pids = rank_pids(proc.pid)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = max(read_metrics(out))
        run_id = (out / "memory_checkpoints.id").read_text().strip()
        output = finish(proc, log, timeout=300)
        ref_output = finish(ref, ref_log, timeout=300)
    finally:
        stop(proc, pids)
        stop(ref)
    assert ref.returncode == 0, ref_output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert killed_at < steps - 1, f"the run finished (step {killed_at}) before the kill"
    found = re.search(r"resumed from the in-memory checkpoint of step (\d+)", output)
    assert found, output[-3000:]
    assert int(found.group(1)) > save, f"resumed at {found.group(1)}, not past disk's {save}"
    assert f"resumed from {out / 'checkpoints'}" not in output, output[-3000:]
    assert [r["step"] for r in metric_records(out)] == list(range(steps))
    want, got = read_metrics(ref_out), read_metrics(out)
    diffs = {
        s: (got[s]["loss"], want[s]["loss"]) for s in want if got[s]["loss"] != want[s]["loss"]
    }
    assert not diffs, f"losses after the restart differ from the uninterrupted run: {diffs}"
    assert not os.path.exists(f"/dev/shm/megatron_lite-{run_id}"), "copies left after the end"
