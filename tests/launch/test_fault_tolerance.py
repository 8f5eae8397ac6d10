"""Failures at run time, through the real launcher (launch/local.sh -> megatron_lite.launch ->
torchrun): a rank killed mid-run (torchrun restarts the group, which resumes from the last
checkpoint and ends with the losses of an uninterrupted run) and a hang (every rank that times
out writes <out_dir>/hang/rank<R>.json, rank 0 says where they are and who wrote none).

Ranks are found through /proc (children of the torchrun process, by their RANK variable), so
the product code carries no test hooks.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks
from tests.launch.test_port_theft import thief_env
from tests.parallel.parity import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")
LOCAL_SH = os.path.join(ROOT, "launch", "local.sh")


# ---------------------------------------------------------------- helpers
def launch(args: list[str], log, env: dict | None = None) -> subprocess.Popen:
    """`launch/local.sh ARGS`, output to the file `log`. local.sh execs the python launcher,
    which execs torchrun: the pid is torchrun's and the ranks are its children."""
    with open(log, "w") as f:
        return subprocess.Popen(
            [LOCAL_SH, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
        )


def finish(proc: subprocess.Popen, log, timeout: float) -> str:
    """Wait for a launch to end; returns its output."""
    proc.wait(timeout=timeout)
    with open(log) as f:
        return f.read()


def stop(proc: subprocess.Popen, pids: dict[int, int] | None = None) -> None:
    """Test cleanup: end the launch and any rank it left behind."""
    for pid in (pids or {}).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def rank_pids(parent: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes below `parent` (the launcher, whose child torchrun
    runs them, or a torchrun agent)."""
    parents, environ = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    below, frontier = set(), {parent}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - below
        below |= frontier
    found = {}
    for pid in below:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError):
            continue
        if b"RANK" in environ and b"TORCHELASTIC_RUN_ID" in environ:
            found[int(environ[b"RANK"])] = pid
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped by torchrun, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def metric_records(out_dir) -> list[dict]:
    """metrics.jsonl in order; a restarted run appends, so redone steps appear twice. Polled
    while rank 0 appends: a read can end inside the record being written (no newline yet), so
    only whole lines count."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def read_metrics(out_dir) -> dict[int, dict]:
    """metrics.jsonl as {step: record}; a step logged twice (after a restart) keeps the last."""
    return {r["step"]: r for r in metric_records(out_dir)}


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before {what}")
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


# ---------------------------------------------------------------- hang diagnostics
def _mismatched_collective(rank, world, out_dir):
    """Rank 0 all-reduces over group A, rank 1 over group B: both wait, both time out."""
    from megatron_lite.parallel import mappings
    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.training import hang_dump

    timeout = datetime.timedelta(seconds=2)
    group_a = dist.new_group([0, 1], timeout=timeout, group_desc="group_a")
    group_b = dist.new_group([0, 1], timeout=timeout, group_desc="group_b")
    t = torch.ones(4)
    STATS.start_step(0)
    mappings.all_reduce(t, group_a)  # both ranks: fine
    STATS.start_step(1)
    try:
        mappings.all_reduce(t, group_a if rank == 0 else group_b)
    except mappings.CollectiveError as e:
        path = hang_dump.write_dump(e, out_dir, rank, world)
        reported = hang_dump.wait_for_peers(out_dir, world, grace_s=10)
        return path, reported, hang_dump.summary(e, out_dir, rank, world, reported)
    return None


def test_mismatched_collective_writes_every_ranks_last_ops(tmp_path):
    """One rank skips a collective (enters another): both time out, both write their file,
    rank 0's message points at the directory."""
    results = run_ranks(2, _mismatched_collective, str(tmp_path), timeout=60)
    assert all(r is not None for r in results), f"a rank did not time out: {results}"
    for rank, (path, reported, _) in enumerate(results):
        assert path == str(tmp_path / "hang" / f"rank{rank}.json")
        assert reported == [0, 1], f"rank {rank} saw files from {reported}"
        with open(path) as f:
            dump = json.load(f)
        group = "group_a" if rank == 0 else "group_b"
        want = {"step": 1, "kind": "all_reduce", "group": group, "shape": [4]}
        assert dump["rank"] == rank and dump["world_size"] == 2 and dump["step"] == 1, dump
        assert dump["last_op"] == {**want, "dtype": "torch.float32"}, dump
        assert dump["last_collective"] == dump["last_op"] and dump["last_p2p"] is None, dump
        assert [op["step"] for op in dump["recent_ops"]] == [0, 1], dump["recent_ops"]
        assert f"rank {rank} step 1: all_reduce" in dump["error"], dump["error"]
    message = results[0][2]
    assert message.startswith("error: rank 0 step 1: all_reduce of shape (4,) on group group_a")
    assert f"{tmp_path / 'hang'}/rank<R>.json (2 of 2 ranks wrote one)" in message, message


def _stalled_object_collective(rank, world):
    """Checkpoint-style control collective (objects, own gloo group) that rank 1 never joins."""
    from megatron_lite.parallel import mappings
    from megatron_lite.parallel.comm_stats import STATS

    ctl = dist.new_group(timeout=datetime.timedelta(seconds=2), group_desc="ckpt_ctl")
    STATS.start_step(7)
    if rank == 1:
        time.sleep(4)  # past rank 0's timeout
        return None
    box = ["latest"]
    try:
        mappings.guarded(
            "checkpoint broadcast",
            ctl,
            lambda: dist.broadcast_object_list(box, src=1, group=ctl),
        )
    except mappings.CollectiveError as e:
        return str(e), STATS.recent[-1]
    return None


def test_checkpoint_control_collective_timeout_names_rank_step_op_group():
    """The error names the op, and a hang dump's last_op would be it too."""
    result = run_ranks(2, _stalled_object_collective, timeout=60)[0]
    assert result is not None, "rank 0 did not time out"
    message, last_op = result
    assert message.startswith("rank 0 step 7: checkpoint broadcast on group ckpt_ctl ranks=[0, 1]")
    assert last_op[:3] == (7, "checkpoint broadcast", "ckpt_ctl"), last_op


def _zero3_stall(rank, world, out_dir, where):
    """ZeRO-3 (FSDP2) on dp2 with parallel.timeout_s=2: at step 1, rank 1 stalls for 4 s in
    the forward of layer 0 (rank 0 waits in FSDP2's next all-gather) or in the last
    microbatch's backward at the embedding (rank 0 waits in the root's reduce-scatter).
    Each rank handles the error as train.main does: hang dump, wait for the peers, message."""
    from megatron_lite.parallel.mappings import CollectiveError
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training import hang_dump
    from megatron_lite.training.trainer import Trainer

    args = [*TINY, "data.mock=true", "train.steps=3", "parallel.dp=2", "parallel.zero_stage=3"]
    overrides = [*args, "parallel.timeout_s=2", f"train.out_dir={out_dir}"]
    cfg, dataset, vocab = prepare(overrides, world_size=world)
    mesh = ParallelMesh(RankLayout(world), timeout_s=cfg.parallel.timeout_s)
    trainer = Trainer(cfg, mesh, dataset, vocab)
    microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * world)
    calls = []

    def stall(*_):
        if rank == 1 and trainer.step == 1:
            calls.append(1)
            if where == "forward" or len(calls) == microbatches:
                time.sleep(4)

    if where == "forward":
        trainer.chunks[0].layers["0"].register_forward_hook(lambda m, i, o: stall())
    else:
        emb = trainer.chunks[0].embedding
        emb.register_forward_hook(lambda m, i, o: o.register_hook(lambda g: stall()) and None)
    try:
        trainer.train()
    except CollectiveError as e:
        path = hang_dump.write_dump(e, out_dir, rank, world)
        reported = hang_dump.wait_for_peers(out_dir, world, grace_s=10)
        return path, hang_dump.summary(e, out_dir, rank, world, reported)
    return None


@pytest.mark.parametrize(
    "where, op", [("forward", "all_gather_fsdp"), ("last backward", "reduce_scatter_fsdp")]
)
def test_zero3_collective_timeout_is_a_hang_with_a_dump(tmp_path, where, op):
    """FSDP2's collectives end like every other: a CollectiveError naming rank, step, op and
    group, the hang dump naming the same op as each rank's last, rank 0's message saying
    where the dumps are (not a raw FSDP2/gloo traceback)."""
    results = run_ranks(2, _zero3_stall, str(tmp_path), where, timeout=90)
    assert all(r is not None for r in results), f"a rank trained through: {results}"
    (path0, message0), (path1, message1) = results
    assert message0.startswith(f"error: rank 0 step 1: {op} of shape ("), message0
    assert " on group dp_cp ranks=[0, 1] failed: " in message0, message0
    assert f"{tmp_path / 'hang'}/rank<R>.json (2 of 2 ranks wrote one)" in message0, message0
    assert message1.startswith("[hang] rank 1 step 1: "), message1  # the peer that stalled
    for rank, path in enumerate((path0, path1)):
        dump = json.loads(open(path).read())
        assert dump["rank"] == rank and dump["step"] == 1, dump
        assert dump["last_op"]["kind"].endswith("_fsdp") and dump["last_op"]["group"] == "dp_cp"
    assert json.loads(open(path0).read())["last_op"]["kind"] == op


@pytest.mark.slow  # in CI's slow tier (bash tests/run.sh -m slow): keeps the suite under 10 min
def test_stalled_rank_cli_reports_hang_files(tmp_path):
    """The real CLI: rank 1 is frozen (SIGSTOP) mid-run, rank 0's collective times out after
    parallel.timeout_s, it writes hang/rank0.json, names the rank that wrote none, exits 1
    (and so does the launcher, with no torchrun report)."""
    out, log = tmp_path / "run", tmp_path / "launch.log"
    args = ["--config", SMOKE, "parallel.tp=2", "parallel.timeout_s=4", "train.steps=100000"]
    proc = launch([*args, "log.progress=false", f"train.out_dir={out}"], log)
    pids = {}
    try:
        wait_for(lambda: len(read_metrics(out)) >= 2, 180, "two training steps", proc)
        pids = rank_pids(proc.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGSTOP)
        wait_for(lambda: not alive(pids[0]), 60, "rank 0 to exit after its timeout", proc)
        # torchrun has seen rank 0's exit and SIGTERMed the frozen rank, which waits 30 s
        # before torchrun's own SIGKILL; this one comes sooner, but a second after rank 0's
        # exit as torchrun's would (a SIGKILL in the same second could be the first failure)
        time.sleep(1.5)
        os.kill(pids[1], signal.SIGKILL)
        output = finish(proc, log, timeout=60)
    finally:
        stop(proc, pids)
    assert proc.returncode == 1, output  # rank 0's code (README: exit codes), not torchrun's
    assert "ChildFailedError" not in output and "Traceback" not in output, output
    hang = out / "hang"
    assert (hang / "rank0.json").exists() and not (hang / "rank1.json").exists(), output
    dump = json.loads((hang / "rank0.json").read_text())
    assert dump["rank"] == 0 and dump["last_op"] is not None, dump
    assert dump["last_op"]["step"] == dump["step"], dump
    assert f"{hang}/rank<R>.json (1 of 2 ranks wrote one; no file from rank(s) 1" in output
    assert "error: rank 0 step" in output, output


# ---------------------------------------------------------------- restart after a killed rank
def test_killed_rank_restarts_group_and_resumes_with_same_losses(tmp_path):
    """torchrun --max-restarts=1: SIGKILL rank 1 after a checkpoint and past it; the group
    restarts, resumes from `latest`, and every step's loss equals an uninterrupted run.

    Under the port thief (tests/launch/test_port_theft.py): every port a process of the launch
    binds and releases is taken at once, and rank 0 starts 3 s late at the restart. The start-up
    loses no port (the first attempt trains: the one restart is left for the kill) and the
    restarted ranks read none of the first attempt's keys."""
    steps, save = 16, 4  # two ranks (tp2): each of the two runs at once has a core
    common = ["--config", SMOKE, "parallel.tp=2", "parallel.dp=1", f"train.steps={steps}"]
    common += [f"train.save_interval={save}", "train.resume=auto", "log.progress=false"]
    ref_out, out = tmp_path / "reference", tmp_path / "killed"
    ref_log, log = tmp_path / "reference.log", tmp_path / "killed.log"
    # both runs at once: their start-ups (most of the time here) overlap
    ref = launch([*common, f"train.out_dir={ref_out}"], ref_log)
    env = thief_env(tmp_path)
    proc = launch(["--max-restarts", "1", *common, f"train.out_dir={out}"], log, env)
    pids = {}
    try:
        # past the first checkpoint, so the restart must both load it and redo some steps
        wait_for(lambda: len(read_metrics(out)) >= save + 2, 240, f"step {save + 2}", proc)
        pids = rank_pids(proc.pid)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = max(read_metrics(out))
        output = finish(proc, log, timeout=300)
        ref_output = finish(ref, ref_log, timeout=300)
    finally:
        stop(proc)
        stop(ref)
    assert ref.returncode == 0, ref_output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert "--standalone --nproc-per-node=2 --max-restarts=1" in output, output[:2000]
    assert "Traceback" not in output, output[-3000:]
    assert killed_at < steps - 1, f"the run finished (step {killed_at}) before the kill"
    assert f"resumed from {out / 'checkpoints'}" in output, output[-3000:]
    logged = [r["step"] for r in metric_records(out)]
    # the restarted group redid the steps after the checkpoint; metrics.jsonl keeps each once
    assert logged == list(range(steps)), logged
    want, got = read_metrics(ref_out), read_metrics(out)
    assert sorted(got) == list(range(steps)), sorted(got)
    diffs = {
        s: (got[s]["loss"], want[s]["loss"]) for s in want if got[s]["loss"] != want[s]["loss"]
    }
    assert not diffs, f"losses after the restart differ from the uninterrupted run: {diffs}"
