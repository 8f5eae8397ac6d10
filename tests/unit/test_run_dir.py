"""One run per run directory, without process groups (world size 1): the lock file names its
holder; a live holder is refused by name; stale locks (dead pid, reused pid, the same Slurm job
requeued) are taken over with a warning; the holder cleans dead saves' leftovers; resume=none
or an older resume over existing checkpoints is refused, and with train.overwrite=true they
are moved aside, never deleted; metrics.jsonl survives a torn last line."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

from megatron_lite.checkpoint import files, run_dir
from megatron_lite.checkpoint.run_dir import Holder, RunDirError, RunLock, claim_run_dir
from megatron_lite.config import load_config
from tests.unit.test_checkpoint_files import fake_save


def cfg_for(out_dir, *overrides):
    return load_config(None, ["data.mock=true", f"train.out_dir={out_dir}", *overrides])


def plant_lock(directory, **changes) -> Holder:
    """A lock file as another run would have written it (defaults: this host, pid 1)."""
    holder = dataclasses.replace(Holder.me(), **{"pid": 1, "start_ticks": None, **changes})
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, run_dir.LOCK), "w") as f:
        json.dump(dataclasses.asdict(holder), f)
    return holder


def lock_holder(directory) -> dict:
    with open(os.path.join(directory, run_dir.LOCK)) as f:
        return json.load(f)


@pytest.fixture
def live_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_lock_names_its_holder_and_is_released(tmp_path):
    lock = RunLock([str(tmp_path)])
    assert lock.acquire() == [] and lock.owned
    holder = lock_holder(tmp_path)
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    again = RunLock([str(tmp_path)])  # train.main took it; the Checkpointer borrows it
    assert again.acquire() == [] and not again.owned
    again.release()
    assert os.path.exists(tmp_path / run_dir.LOCK), "a borrower released the lock"
    lock.release()
    assert not os.path.exists(tmp_path / run_dir.LOCK)


def test_live_holder_is_refused_by_name(tmp_path, live_process):
    from megatron_lite.checkpoint.lock_file import process_start_ticks as _start_ticks

    plant_lock(tmp_path, pid=live_process.pid, start_ticks=_start_ticks(live_process.pid))
    before = lock_holder(tmp_path)
    with pytest.raises(RunDirError) as e:
        claim_run_dir(cfg_for(tmp_path), rank=0, world=1)
    msg = str(e.value)
    assert f"in use by another run (host {socket.gethostname()}, pid {live_process.pid}" in msg
    assert "Slurm job none" in msg and "Fix:" in msg and str(tmp_path / run_dir.LOCK) in msg
    assert lock_holder(tmp_path) == before, "a refused run touched the holder's lock"


def test_dead_or_reused_pid_lock_is_taken_over(tmp_path, live_process, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    plant_lock(tmp_path, pid=dead.pid)
    lock = claim_run_dir(cfg_for(tmp_path), rank=0, world=1)
    assert f"process {dead.pid} on {socket.gethostname()} is gone" in capsys.readouterr().err
    assert lock_holder(tmp_path)["pid"] == os.getpid()
    lock.release()
    # a live pid whose process started at another time is a reused pid: stale too
    plant_lock(tmp_path, pid=live_process.pid, start_ticks=1)
    lock = RunLock([str(tmp_path)])
    assert "is gone" in lock.acquire()[0]
    lock.release()


def test_same_slurm_job_requeued_takes_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    plant_lock(tmp_path, host="node-that-died", slurm_job_id="4242")
    lock = RunLock([str(tmp_path)])
    warnings = lock.acquire()
    assert "this Slurm job 4242 before it was requeued" in warnings[0], warnings
    assert lock_holder(tmp_path)["slurm_job_id"] == "4242" and lock.owned
    lock.release()
    plant_lock(tmp_path, host="node-that-died", slurm_job_id="4241")  # another job: refused
    with pytest.raises(RunDirError, match="host node-that-died, pid 1, Slurm job 4241"):
        RunLock([str(tmp_path)]).acquire()


def test_release_keeps_a_lock_another_run_took_over(tmp_path):
    lock = RunLock([str(tmp_path)])
    lock.acquire()
    plant_lock(tmp_path, host="elsewhere")
    lock.release()
    assert lock_holder(tmp_path)["host"] == "elsewhere"


def test_ckpt_dir_outside_out_dir_is_locked_too(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "shared-ckpt"
    plant_lock(ckpt, host="elsewhere")
    with pytest.raises(RunDirError, match=f"run directory {ckpt} is in use"):
        claim_run_dir(cfg_for(out, f"train.ckpt_dir={ckpt}"), rank=0, world=1)
    assert not os.path.exists(out / run_dir.LOCK), "a refused run kept half of the locks"


def test_stale_temporaries_are_cleaned_by_the_holder(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    fake_save(str(ckpt), 10)
    os.makedirs(ckpt / ".tmp-step_20")
    (ckpt / ".tmp-step_20" / "__0_0.distcp").write_bytes(b"partial")
    (ckpt / "latest.tmp.999").write_text("step_20\n")
    (tmp_path / "metrics.jsonl.tmp.999").write_text('{"step": 0}\n')
    claim_run_dir(cfg_for(tmp_path), rank=0, world=1).release()
    assert sorted(os.listdir(ckpt)) == ["latest", "step_10"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]
    assert "removed leftovers of unfinished saves" in capsys.readouterr().out


def test_resume_none_over_checkpoints_is_refused_then_moved_aside(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (10, 20):
        fake_save(str(ckpt), step)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    sha = files.sha256_file(ckpt / "step_10" / "__0_0.distcp")
    with pytest.raises(RunDirError) as e:
        claim_run_dir(cfg_for(tmp_path, "train.resume=none"), rank=0, world=1)
    assert "step_20, step_10" in str(e.value) and "train.overwrite=true" in str(e.value)
    assert sorted(os.listdir(ckpt)) == ["latest", "step_10", "step_20"]
    assert not os.path.exists(tmp_path / run_dir.LOCK)
    cfg = cfg_for(tmp_path, "train.resume=none", "train.overwrite=true")
    claim_run_dir(cfg, rank=0, world=1).release()
    assert os.listdir(ckpt) == []
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("overwritten-")]
    moved = tmp_path / aside
    assert sorted(os.listdir(moved / "checkpoints")) == ["latest", "step_10", "step_20"]
    assert (moved / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert not (tmp_path / "metrics.jsonl").exists()
    files.verify(str(moved / "checkpoints" / "step_20"))  # intact, not copied halfway
    assert files.sha256_file(moved / "checkpoints" / "step_10" / "__0_0.distcp") == sha


def test_resume_from_an_older_step_moves_only_the_newer_ones(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        fake_save(str(ckpt), step, keep=3)
    older = f"train.resume={ckpt / 'step_10'}"
    with pytest.raises(RunDirError, match=r"would not continue from: step_30, step_20\."):
        claim_run_dir(cfg_for(tmp_path, older), rank=0, world=1)
    claim_run_dir(cfg_for(tmp_path, older, "train.overwrite=true"), rank=0, world=1).release()
    assert sorted(os.listdir(ckpt)) == ["step_10"]  # latest named step_30: moved with it
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("overwritten-")]
    assert sorted(os.listdir(tmp_path / aside / "checkpoints")) == ["latest", "step_20", "step_30"]


# ------------------------------------------------------------------ metrics.jsonl
def _logger(out_dir):
    from megatron_lite.training.logging import MetricsLogger

    return MetricsLogger(cfg_for(out_dir, "log.progress=false"), active=True)


def test_torn_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(4))
    path.write_text(whole + '{"step": 4, "lo')  # the run died mid-write
    logger = _logger(tmp_path)
    logger.log({"step": 3, "loss": 2.0}, first_step=3)  # resumed from step 3
    logger.close()
    err = capsys.readouterr().err
    assert "metrics.jsonl line 5 is not a whole record, dropped" in err, err
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    assert path.read_text().splitlines()[:3] == whole.splitlines()[:3], "records changed"


def test_fresh_start_moves_old_metrics_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 9.0}\n{"step": 1, "loss": 8.0}\n')
    logger = _logger(tmp_path)
    logger.log({"step": 0, "loss": 1.0}, first_step=0)
    logger.close()
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("overwritten-")]
    assert (tmp_path / aside / "metrics.jsonl").read_text().count("\n") == 2
    assert [json.loads(x)["loss"] for x in path.read_text().splitlines()] == [1.0]


def test_takeover_mutex_left_by_a_dead_run_is_cleared(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    plant_lock(tmp_path, host=socket.gethostname(), pid=dead.pid)  # no such process
    mutex = tmp_path / run_dir.TAKEOVER
    mutex.mkdir()
    old = os.stat(mutex).st_mtime - run_dir.TAKEOVER_STALE_S - 1
    os.utime(mutex, (old, old))
    lock = RunLock([str(tmp_path)])
    assert "is gone" in lock.acquire()[0] and lock.owned
    assert not mutex.exists()
    lock.release()
    assert os.listdir(tmp_path) == [], "the lock left files behind"
