"""The launcher exits with the ranks' exit code (README, exit codes), without torchrun's report.

`megatron_lite.torchrun.exit_code` is the rule for what the ranks' codes make (a table, no
processes); then real launches (python -m megatron_lite.launch -> supervise -> torchrun's
agent -> 1 or 2 ranks), started side by side so their start-ups overlap: a run-directory lock no run
wrote and a damaged checkpoint named by train.resume exit 2 with the rank's one paragraph, a
non-finite step exits 3 naming step 1 (1-based, as the progress line), a rank killed with
SIGKILL mid-run makes it 137 with a line naming the rank. None prints torchrun's
ChildFailedError report or a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_lite.torchrun import exit_code
from tests.launch.test_fault_tolerance import metric_records, rank_pids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
TERM, KILL, SEGV = -signal.SIGTERM, -signal.SIGKILL, -signal.SIGSEGV

# (case id, {rank: (exit code, time)}, the launcher's code, words its line must hold or None)
RULE = [
    ("one-user-error", {0: (2, 5)}, 2, None),
    ("agreed-user-error", {0: (2, 5), 1: (2, 5), 2: (2, 6)}, 2, None),
    ("user-error-others-stopped", {1: (2, 5), 0: (TERM, 5), 2: (TERM, 6)}, 2, None),
    ("agreed-nonfinite", {0: (3, 5), 1: (3, 5)}, 3, None),
    ("crash", {1: (1, 5), 0: (TERM, 5)}, 1, None),
    ("crash-then-killed", {1: (1, 5), 0: (KILL, 35)}, 1, None),  # torchrun's SIGKILL, later
    ("ctrl-c-before-training", {0: (130, 5), 1: (130, 5)}, 130, None),
    ("first-decides", {0: (2, 5), 1: (1, 6)}, 2, None),
    ("codes-differ", {0: (2, 5), 1: (1, 5)}, 1, "rank 0: exit code 2, rank 1: exit code 1"),
    ("codes-differ-3-2", {0: (3, 5), 1: (2, 5)}, 1, "different exit codes"),
    ("oom-killed-peer-exits", {0: (1, 5), 1: (KILL, 5)}, 137, "rank 1 was killed by SIGKILL"),
    ("killed-then-stopped", {0: (TERM, 5), 1: (KILL, 5)}, 137, "rank 1 was killed by SIGKILL"),
    ("segfault-first", {0: (SEGV, 4), 1: (TERM, 5)}, 139, "rank 0 was killed by SIGSEGV"),
    ("only-sigterm", {0: (TERM, 5), 1: (TERM, 5)}, 143, "rank 0 was killed by SIGTERM"),
    ("earlier-sigterm-wins", {0: (KILL, 6), 1: (TERM, 5)}, 143, "rank 1 was killed by SIGTERM"),
]


@pytest.mark.parametrize("case, failures, code, words", RULE, ids=[c[0] for c in RULE])
def test_the_ranks_codes_make_the_launchers(case, failures, code, words):
    got, line = exit_code(failures)
    assert got == code, (got, line)
    if words is None:  # the rank printed its message; nothing is added to it
        assert line is None, line
    else:
        assert line is not None and words in line and f"exit {code}" in line, line


# ---------------------------------------------------------------- the real launcher
def _launch(out_dir, *overrides, ranks: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_lite.launch", "--config", SMOKE, f"parallel.dp={ranks}"]
    cmd += [f"train.out_dir={out_dir}", "log.progress=false", *overrides]
    env = dict(os.environ, PYTHONPATH=ROOT, MEGATRON_LITE_QUIET="1")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow  # 31 s (the suite's budget): test_cli keeps the one-paragraph errors
@pytest.mark.timeout(240)
def test_launcher_exits_with_the_ranks_code_and_message(tmp_path):
    # a lock no run wrote (a dangling link): refused after the process group exists, on
    # every rank (exit_together)
    locked = tmp_path / "locked"
    locked.mkdir()
    os.symlink(tmp_path / "gone", locked / "run.lock")
    # a checkpoint whose metadata.json is a JSON array, named by train.resume
    ckpt = tmp_path / "damaged" / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text(json.dumps([{"step": 4}]))
    cases = {  # case: (the launch, exit code, what its stderr must name)
        "lock": (_launch(locked), 2, f"the run directory lock {locked / 'run.lock'} is a symbolic"),
        "metadata": (  # one rank: the ranks' agreement on it is tested on forked ranks
            _launch(tmp_path / "damaged", f"train.resume={ckpt}", ranks=1),
            2,
            f"{ckpt / 'metadata.json'} is damaged: it holds a JSON array",
        ),
        "nonfinite": (
            _launch(tmp_path / "nan", "model.init_method_std=1e30", ranks=1),
            3,
            "error: step 1: the gradient norm is nan",
        ),
    }
    killed = _launch(tmp_path / "killed", "train.steps=100000")  # rank 1 gets SIGKILL
    outputs = {}
    try:
        deadline = time.monotonic() + 150
        while len(metric_records(tmp_path / "killed")) < 2:  # training runs
            assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()
            time.sleep(0.2)
        os.kill(rank_pids(killed.pid)[1], signal.SIGKILL)  # as the OOM killer would
        for case, (proc, _, _) in cases.items():
            outputs[case] = proc.communicate(timeout=200)
        out, err = killed.communicate(timeout=120)
    finally:
        for proc in [killed, *(proc for proc, _, _ in cases.values())]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # the first rank to fail decides: rank 0 then exits 1 (its peer is gone), after it
    assert killed.returncode == 128 + signal.SIGKILL, (killed.returncode, err[-3000:])
    assert "[launch] rank 1 was killed by SIGKILL" in err, err[-3000:]
    for noise in ("Traceback", "ChildFailedError", "failed (exitcode", "Root Cause"):
        assert noise not in out + err, ("killed", noise, err[-3000:])
    for case, (proc, code, needle) in cases.items():
        out, err = outputs[case]
        assert proc.returncode == code, (case, proc.returncode, err[-3000:])
        assert needle in err, (case, err[-3000:])
        errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and "Fix:" in errors[0], (case, err[-3000:])
        for noise in ("Traceback", "ChildFailedError", "failed (exitcode", "Root Cause"):
            assert noise not in out + err, (case, noise, err[-3000:])
    assert not os.path.lexists(tmp_path / "gone"), "the refused run followed the link"


def test_submit_checks_step_wait_before_queueing(tmp_path):
    """STEP_WAIT_S reaches srun on the compute nodes (train.sbatch): submit.sh checks it as a
    count on the login node, so a typo fails before anything is queued."""
    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch-called\n")
    fake.chmod(0o755)
    submit = os.path.join(ROOT, "launch", "slurm", "submit.sh")
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", STEP_WAIT_S="2m")
    r = subprocess.run(
        [submit, "2", "8", SMOKE], env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2 and "error: STEP_WAIT_S='2m'" in r.stderr, r.stderr
    assert "Fix:" in r.stderr and not (tmp_path / "sbatch-called").exists()


def test_a_lost_rendezvous_is_one_line_and_exit_1(monkeypatch, capsys):
    """A node whose agent loses the store (its host, another node's agent, ended first: seen
    on the refused Slurm job) prints one line naming it and exits 1, no traceback."""
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from megatron_lite import torchrun

    def lost(args):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(torch_run, "run", lost)
    with pytest.raises(SystemExit) as stop:
        torchrun.main(["--nnodes=1", "--nproc-per-node=1", "-m", "megatron_lite.train"])
    err = capsys.readouterr().err
    assert stop.value.code == 1, err
    assert "lost the rendezvous" in err and "RendezvousConnectionError" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
