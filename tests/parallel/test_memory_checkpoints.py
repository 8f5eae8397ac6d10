"""In-memory checkpoints (checkpoint/memory.py) on forked gloo ranks with the real Trainer: a
restarted group resumes from the newest copy complete on every rank (its own, or the peer's
replica when its own is gone) with the losses of an uninterrupted run, bitwise; a failed
write is one error naming the key and the path on every rank; /dev/shm too small refuses to
start. The kill -9 of a rank under torchrun is tests/launch/test_memory_restart.py."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY

STEPS = ["train.steps=6", "data.mock=true", "parallel.tp=1"]


def _trainer(rank, world, out_dir, overrides, restart: int):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    cfg, dataset, vocab = prepare([*TINY, *STEPS, f"train.out_dir={out_dir}", *overrides], world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    return Trainer(cfg, mesh, dataset, vocab)


def _run(rank, world, out_dir, overrides, crash_after, drop_own):
    """Train; with `crash_after` stop after that many steps leaving the copies (as a killed
    group would), optionally delete rank `drop_own`'s own copies (its node is gone), and
    build a restarted trainer that trains to the end -> (losses by step, restart step,
    memckpt_s values, files left)."""
    import torch.distributed as dist

    trainer = _trainer(rank, world, out_dir, overrides, restart=0)
    losses, saves = {}, []
    if crash_after is not None:
        trainer.signals.install()
        while trainer.step < crash_after:
            record = trainer.train_step()
            trainer.signals.after_step(record, trainer.step, trainer.consumed_samples, False)
            losses[record["step"]] = record["loss"]
            saves += [record["memckpt_s"]] if "memckpt_s" in record else []
        trainer.signals.restore()
        trainer.checkpointer.directory.release()  # the run lock, as a dead process leaves it
        memdir = trainer.checkpointer.memory.dir
        dist.barrier()
        if rank == drop_own:
            for f in glob.glob(os.path.join(memdir, f"rank{rank}-step*.bin")):
                os.remove(f)
        dist.barrier()
        trainer = _trainer(rank, world, out_dir, overrides, restart=1)
    start = trainer.step
    for r in trainer.train():
        losses[r["step"]] = r["loss"]
    left = glob.glob(os.path.join(trainer.checkpointer.memory.dir, "*"))
    return losses, start, saves, left


@pytest.mark.slow  # three trainers on two ranks: ~20 s on 2 cores
@pytest.mark.parametrize(
    "save_interval, crash_after, drop_own, start",
    [(0, 5, 0, 4), (3, 3, None, 3)],
    ids=["peer-replica", "disk-newer"],
)
def test_restart_resumes_from_the_newest_with_the_same_losses(
    tmp_path, save_interval, crash_after, drop_own, start
):
    """2 ranks, copies every 2 steps. peer-replica: no disk checkpoints, stopped after step 5
    (copies of steps 2 and 4 left) and rank 0's own copies deleted: the restart takes step 4
    from rank 1's replica. disk-newer: disk every 3 steps, stopped after step 3: the disk's
    step 3 is newer than the copy of step 2 and wins. Every loss equals the run's without the
    restart, bitwise (the same arithmetic on the same restored bytes)."""
    common = ["train.memory_checkpoint_interval=2", f"train.save_interval={save_interval}"]
    ref = run_ranks(2, _run, str(tmp_path / "ref"), common, None, None, timeout=120)[0]
    got = run_ranks(2, _run, str(tmp_path / "run"), common, crash_after, drop_own, timeout=120)
    losses, restarted_at, saves, left = got[0]
    assert restarted_at == start, f"restarted at step {restarted_at}, expected {start}"
    assert len(saves) == crash_after // 2, saves  # a copy every 2 steps
    assert losses == ref[0], f"losses differ after the restart: {losses} vs {ref[0]}"
    assert left == [] and got[1][3] == [], "the copies are removed at a clean end"


def _failing_write(rank, world, out_dir):
    """Disk checkpoint at step 2, then rank 1's copy of step 3 fails (ENOSPC) -> each rank's
    error, and whether step_2 on disk is still intact."""
    import errno

    from megatron_lite.checkpoint import files
    from megatron_lite.checkpoint import memory_files as mf

    write = mf.write_copy

    def full(path, meta, tensors):
        if rank == 1 and meta["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write(path, meta, tensors)

    mf.write_copy = full
    overrides = ["train.memory_checkpoint_interval=3", "train.save_interval=2"]
    trainer = _trainer(rank, world, out_dir, overrides, restart=0)
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        ckpt = os.path.join(out_dir, "checkpoints", "step_2")
        shutil.rmtree(trainer.checkpointer.memory.dir, ignore_errors=True)  # a crash keeps it
        return type(e).__name__, str(e), files.quick_check(ckpt), trainer.step
    return None


def test_failed_write_is_one_error_naming_key_and_path(tmp_path):
    results = run_ranks(2, _failing_write, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} trained through a failed write"
        kind, message, damage, step = result
        assert kind == "CheckpointWriteError", (rank, kind, message)
        assert "train.memory_checkpoint_interval=3" in message, message
        assert "/dev/shm/megatron_lite-" in message and "rank1-step3.bin" in message, message
        assert "No space left on device" in message and "disk checkpoints are untouched" in message
        assert damage is None and step == 3, (damage, step)  # step_2 intact, stopped at 3


def _small_shm(rank, world, out_dir):
    """/dev/shm reports 1 MiB free: the start is refused on every rank."""
    import types

    from megatron_lite.checkpoint import memory

    memory.os.statvfs = lambda path: types.SimpleNamespace(f_bavail=256, f_frsize=4096)
    try:
        _trainer(rank, world, out_dir, ["train.memory_checkpoint_interval=2"], restart=0)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def test_too_small_shm_is_refused_at_start_naming_the_key(tmp_path):
    for result in run_ranks(2, _small_shm, str(tmp_path), timeout=120):
        assert result is not None, "started with a /dev/shm too small"
        kind, message = result
        assert kind == "CheckpointWriteError", message
        assert "train.memory_checkpoint_interval=2" in message and "0.00 GiB free" in message
        assert "Fix: free space in /dev/shm" in message, message


def _across_hosts(rank, world, root):
    """MemoryCheckpoints on ranks that pretend to be on two hosts: the replica goes over the
    process group; rank 0's own copy is then lost and its load comes from rank 1."""
    import torch
    import torch.distributed as dist

    from megatron_lite.checkpoint import memory_files as mf
    from megatron_lite.checkpoint.memory import MemoryCheckpoints
    from megatron_lite.checkpoint.rank_agreement import RankAgreement
    from megatron_lite.config import load_config

    overrides = ["parallel.dp=2", "train.memory_checkpoint_interval=1", f"train.out_dir={root}"]
    cfg = load_config(None, [*TINY, *overrides])
    ranks = RankAgreement(rank, world, dist.group.WORLD)
    shm = os.path.join(root, f"host{rank}")  # each "host" has a /dev/shm of its own
    os.makedirs(shm)
    mem = MemoryCheckpoints(cfg, rank, world, ranks, dist.group.WORLD, root=shm)
    mem.hosts = ["node-a", "node-b"]
    g = torch.Generator().manual_seed(rank)
    state = {
        "w": torch.randn(70_000, generator=g).to(torch.bfloat16),
        "m": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "step": torch.tensor(7),
    }
    import megatron_lite.checkpoint.memory as memory

    memory.CHUNK = 50_000  # bytes: several messages per copy
    mem.save(1, 16, state)
    replica = os.path.join(mem.dir, mf.replica_name(mem.source, 1, rank))
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(mem.dir, mf.own_name(0, 1)))
    dist.barrier()
    plan = mem.plan()
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    header = mem.load(plan, targets)
    same = all(torch.equal(targets[k], state[k]) for k in state)
    return os.path.exists(replica), plan.sources[rank][0], header["consumed_samples"], same


def test_replica_over_the_group_restores_a_lost_copy(tmp_path):
    results = run_ranks(2, _across_hosts, str(tmp_path), timeout=60)
    (replica0, holder0, consumed0, same0), (replica1, holder1, _, same1) = results
    assert replica0 and replica1, "each rank holds its source's replica"
    assert (holder0, holder1) == (1, 1), "rank 0 loads rank 1's replica, rank 1 its own copy"
    assert consumed0 == 16 and same0 and same1, "the loaded tensors differ from the saved"


def _other_runs(rank, world, out_dir):
    """Copies of steps 1 and 2 left by a dead group; then a restart whose model settings differ
    (model.norm_eps), and a fresh launch (restart count 0) -> (their steps, whether the dead
    group's copies still exist after each)."""
    import torch.distributed as dist

    every = ["train.memory_checkpoint_interval=1"]
    trainer = _trainer(rank, world, out_dir, every, restart=0)
    for _ in range(2):
        record = trainer.train_step()
        trainer.signals.after_step(record, trainer.step, trainer.consumed_samples, False)
    trainer.checkpointer.directory.release()
    old = trainer.checkpointer.memory.dir
    other = _trainer(rank, world, out_dir, [*every, "model.norm_eps=1e-6"], restart=1)
    other.checkpointer.directory.release()
    kept = os.path.exists(os.path.join(old, f"rank{rank}-step2.bin"))
    dist.barrier()
    fresh = _trainer(rank, world, out_dir, every, restart=0)
    fresh.checkpointer.directory.release()
    gone = not os.path.exists(old)
    shutil.rmtree(fresh.checkpointer.memory.dir, ignore_errors=True)
    return other.step, kept, fresh.step, gone


def test_copies_are_only_loaded_by_a_restart_of_the_same_run(tmp_path):
    for rank, (other, kept, fresh, gone) in enumerate(
        run_ranks(2, _other_runs, str(tmp_path), timeout=120)
    ):
        assert other == 0 and kept, f"rank {rank}: other settings loaded the copies ({other})"
        assert fresh == 0 and gone, f"rank {rank}: a fresh launch loaded ({fresh}) or kept them"
