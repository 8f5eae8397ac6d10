"""In-memory checkpoints (checkpoint/memory.py) on forked gloo ranks with the real Trainer: a
restarted group resumes from the newest copy complete on every rank (its own, or the peer's
replica when its own is gone) with the losses of an uninterrupted run, bitwise; a failed
write is one error naming the key and the path on every rank; /dev/shm too small refuses to
start. The kill -9 of a rank under torchrun is tests/launch/test_memory_restart.py."""

from __future__ import annotations

import glob
import os

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


def test_restart_resumes_from_memory_with_the_same_losses(tmp_path):
    """2 ranks, copies every 2 steps, disk every 4: killed after step 5 (copies of steps 2
    and 4 left, disk at 4 is older... equal: memory wins a tie), rank 0's own copies gone:
    the restart takes step 4 from rank 1's replica, and every loss equals the run's without
    the restart, bitwise (the same arithmetic on the same restored bytes)."""
    common = ["train.memory_checkpoint_interval=2", "train.save_interval=0"]
    ref = run_ranks(2, _run, str(tmp_path / "ref"), common, None, None, timeout=120)[0]
    got = run_ranks(2, _run, str(tmp_path / "run"), common, 5, 0, timeout=120)
    losses, start, saves, left = got[0]
    assert start == 4, f"restarted at step {start}, expected the in-memory step 4"
    assert len(saves) == 2, saves  # steps 2 and 4
    assert losses == ref[0], f"losses differ after the restart: {losses} vs {ref[0]}"
    assert left == [] and got[1][3] == [], "the copies are removed at a clean end"
