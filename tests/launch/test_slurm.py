"""launch/slurm on a real two-node Slurm cluster (tests/launch/slurm_cluster.py, on this machine):
a 2-node × 2-rank job of the quickstart layout (tp=2 with sequence parallelism × dp=2, smoke
model on mock data, gloo) runs to completion through train.sbatch, a job preempted with
SIGUSR1 checkpoints, requeues itself, resumes from `latest` and ends with exactly the losses of
the uninterrupted job, and a job its ranks refuse (exit 2) ends with exit code 2.

The jobs run at once (the nodes have room for them): ~1 minute on the 2-core CI machine.
Needs root (it starts slurmctld, two slurmd and munged); installs Debian's Slurm if missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.launch.slurm_cluster import SlurmCluster, ensure_installed, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")
SUBMIT = os.path.join(ROOT, "launch", "slurm", "submit.sh")
STEPS = 20  # the preempted job is signalled after 5
TRAIN_ARGS = [
    "--config", os.path.join(ROOT, "configs", "smoke.yaml"),
    "parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true",
    f"train.steps={STEPS}", "train.save_interval=1000",  # saves only on the signal and at the end
]  # fmt: skip
JOB_TIMEOUT = 180


def records(out_dir) -> list[dict]:
    """metrics.jsonl's whole lines: polled while rank 0 appends, a read can end inside the
    record being written (no newline yet)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def job_logs(log_root, name: str, job: int, tail: int = 4000) -> str:
    """The batch log and every node log of a job (the last `tail` characters of each)."""
    parts = []
    for path in [log_root / f"{name}-{job}.out", *sorted((log_root / f"{name}-{job}").glob("*"))]:
        if path.is_file():
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts)


def rank0_log(log_root, name: str, job: int) -> str:
    """The node log with rank 0's output (c10d hands out node ranks in join order)."""
    for path in sorted((log_root / f"{name}-{job}").glob("node*.log")):
        text = path.read_text(errors="replace")
        if "rank map" in text:
            return text
    return ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: brings up slurmctld, two slurmd and munged as root")
    t0 = time.monotonic()
    install_s = ensure_installed()
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        print(f"[slurm] install {install_s:.1f}s, bring-up {time.monotonic() - t0:.1f}s")
        yield c
        c.run(["scancel", "--user=root"], check=False)  # leave no job processes behind
        deadline = time.monotonic() + 30
        while c.run(["squeue", "-h"], check=False).stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Submits the uninterrupted job (plain sbatch) and the to-be-preempted one (submit.sh)."""
    work = tmp_path_factory.mktemp("jobs")
    log_root = work / "logs"
    log_root.mkdir()
    env = {
        "CPU_ONLY": "1",
        "NPROC_PER_NODE": "2",
        "LOG_ROOT": str(log_root),
        "MEGATRON_LITE_ROOT": ROOT,
    }
    ref = cluster.sbatch(
        [
            "--nodes=2",
            "--job-name=ref",
            f"--output={log_root}/%x-%j.out",
            SBATCH,
            *TRAIN_ARGS,
            f"train.out_dir={work / 'ref'}",
        ],  # fmt: skip
        # a rendezvous port of its own: the script's default (20000 + job id) is the same for
        # job 2 of another test cluster on this machine (a second suite running at once)
        env=dict(env, RDZV_PORT=str(free_port())),
        cwd=work,
    )
    # a job its ranks refuse: a run.lock no run wrote (a dangling link) in its out_dir; one
    # rank a node (tp=1) is enough, and keeps the three jobs' start-ups light on 2 cores
    (work / "refused").mkdir()
    os.symlink(work / "gone", work / "refused" / "run.lock")
    refused = cluster.sbatch(
        [
            "--nodes=2",
            "--job-name=refused",
            f"--output={log_root}/%x-%j.out",
            SBATCH,
            *TRAIN_ARGS,
            "parallel.tp=1",
            "parallel.sequence_parallel=false",
            f"train.out_dir={work / 'refused'}",
        ],  # fmt: skip
        env=dict(env, NPROC_PER_NODE="1", RDZV_PORT=str(free_port())),
        cwd=work,
    )
    r = subprocess.run(
        [SUBMIT, "2", "0", *TRAIN_ARGS[1:], f"train.out_dir={work / 'preempt'}"],
        env=dict(cluster.env, **env, SBATCH_ARGS="--job-name=preempt", RDZV_PORT=str(free_port())),
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    preempt = int(r.stdout.strip())
    # preempt as soon as it trains (from here, so the signal can't come after the job ended)
    deadline = time.monotonic() + JOB_TIMEOUT
    while len(records(work / "preempt")) < 5:
        state = cluster.job(preempt)["JobState"]
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
            f"job {preempt} is {state} before 5 steps\n{job_logs(log_root, 'preempt', preempt)}"
        )
        time.sleep(0.1)
    cluster.run(["scancel", "--signal=USR1", "--batch", str(preempt)])
    signalled = time.monotonic()
    jobs = {"work": work, "log_root": log_root, "ref": ref, "preempt": preempt, "t": signalled}
    return {**jobs, "refused": refused}


def test_two_node_job_runs_to_completion(cluster, jobs):
    job, work, log_root = jobs["ref"], jobs["work"], jobs["log_root"]
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), JOB_TIMEOUT)
    logs = job_logs(log_root, "ref", job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{logs}"
    assert info["NodeList"] == "n[1-2]" and info["Restarts"] == "0", info
    assert [r["step"] for r in records(work / "ref")] == list(range(STEPS)), logs
    batch = (log_root / f"ref-{job}.out").read_text()
    assert "2 node(s) n[1-2] x 2 ranks, rendezvous n1:" in batch, batch
    assert sorted(p.name for p in (log_root / f"ref-{job}").glob("node*.log")) == [
        "node0.log",
        "node1.log",
    ], logs
    rank0 = rank0_log(log_root, "ref", job)
    assert "rank map (order tp-cp-ep-dp-pp; tp=2 cp=1 ep=1 dp=2 pp=1)" in rank0, rank0
    assert f"step    {STEPS}/{STEPS}" in rank0, rank0


def test_preempted_job_checkpoints_requeues_and_resumes_exactly(cluster, jobs):
    """SIGUSR1 to the batch shell after 5 steps (`jobs`; as `--signal=B:USR1@300` would):
    the ranks checkpoint and stop, the script requeues the job, the second run resumes from
    `latest`; every step is logged once and every loss equals the uninterrupted job's."""
    job, work, log_root = jobs["preempt"], jobs["work"], jobs["log_root"]
    out = work / "preempt"
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), JOB_TIMEOUT)
    resumed_s = time.monotonic() - jobs["t"]
    logs = job_logs(log_root, "preempt", job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{logs}"
    batch = (log_root / f"preempt-{job}.out").read_text()
    assert "got SIGUSR1" in batch and f"requeueing job {job}" in batch, batch
    assert "restart 1:" in batch, batch
    nodes = job_logs(log_root, "preempt", job, tail=10**6)  # rank 0 may change nodes
    assert "received SIGUSR1: checkpoint saved at step" in nodes, nodes  # as the job got it
    assert "[checkpoint] resumed from" in nodes, nodes
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(STEPS)), f"steps redone or skipped across the requeue: {steps}"
    assert (out / "checkpoints" / "latest").exists(), logs
    cluster.wait(jobs["ref"], "COMPLETED", JOB_TIMEOUT)
    want = {r["step"]: r["loss"] for r in records(work / "ref")}
    got = {r["step"]: r["loss"] for r in records(out)}
    diffs = {s: (got[s], want[s]) for s in want if got.get(s) != want[s]}
    assert not diffs, f"losses (requeued, uninterrupted) differ: {diffs}"
    print(f"[slurm] signal -> requeued run completed in {resumed_s:.1f}s")


def test_a_job_the_ranks_refuse_exits_with_their_code(cluster, jobs):
    """Both ranks (one per node) refuse the run directory (exit 2, agreed after the process
    group exists): each node's torchrun, srun and so the job exit 2 (not torchrun's 1), and
    the logs hold the rank's one paragraph, no torchrun report and no traceback."""
    job, log_root = jobs["refused"], jobs["log_root"]
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), JOB_TIMEOUT)
    logs = job_logs(log_root, "refused", job, tail=10**6)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{logs}"
    assert info["Restarts"] == "0", info  # a user error is not requeued
    assert "training finished with exit code 2" in logs, logs
    lock = jobs["work"] / "refused" / "run.lock"
    assert logs.count(f"error: the run directory lock {lock} is a symbolic link") == 1, logs
    for noise in ("ChildFailedError", "Traceback", "failed (exitcode"):
        assert noise not in logs, (noise, logs)


def test_submit_rejects_a_bad_layout_before_queueing(tmp_path):
    """submit.sh validates the config for nodes × ranks per node on the login node: one
    paragraph, exit 2, nothing queued (a stand-in sbatch on PATH records any call)."""
    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch-called\n")
    fake.chmod(0o755)
    r = subprocess.run(
        [SUBMIT, "2", "0", *TRAIN_ARGS[1:3], "parallel.tp=2", "parallel.dp=4"],
        env=dict(os.environ, NPROC_PER_NODE="2", PATH=f"{tmp_path}:{os.environ['PATH']}"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "world size 4 must equal tp·pp·cp·dp = 2·1·1·4 = 8" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert not (tmp_path / "sbatch-called").exists(), "submit.sh called sbatch"
