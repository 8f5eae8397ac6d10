"""This run's checkpoint directory as every rank sees it, opened before the model exists.

`CheckpointDir(cfg)` (collective) makes the gloo process groups checkpointing runs on, takes
the run directory's lock (run_dir.py: a no-op when train.main already holds it, so a Trainer
used without train.main is covered too) and answers `will_load()`: whether resume will fill
the model from a checkpoint. The Trainer asks that before it builds the model (weights a
checkpoint fills are never drawn, and under ZeRO-3 from scratch they are drawn before FSDP2
shards them), so this part cannot wait for the Checkpointer, which needs the model.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.memory import MemoryCheckpoints
from megatron_lite.checkpoint.rank_agreement import RankAgreement
from megatron_lite.checkpoint.run_dir import ckpt_dir_of, claim_run_dir
from megatron_lite.parallel import mappings

__all__ = ["CheckpointDir"]


class CheckpointDir:
    """`path` (train.ckpt_dir), the process groups and the run lock of one run's checkpoints;
    every method is called on every rank in the same order."""

    def __init__(self, cfg) -> None:
        self.cfg, t = cfg, cfg.train
        self.path = ckpt_dir_of(cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        timeout = timedelta(seconds=cfg.parallel.timeout_s)
        host = mappings.host_backend()
        # DCP's collectives run on a writer thread: they get groups of their own
        self.io_group = dist.new_group(backend=host, timeout=timeout, group_desc="ckpt_io")
        self.ctl_group = dist.new_group(backend=host, timeout=timeout, group_desc="ckpt_ctl")
        self.ranks = RankAgreement(self.rank, self.world, self.ctl_group)  # errors agreed
        # an async save runs beside training and may take longer than a collective may: its
        # collectives (DCP's, on the writer thread, and the agreement at the next save or at
        # the end) use a group of their own with train.async_save_timeout_s
        slow = timedelta(seconds=max(t.async_save_timeout_s, cfg.parallel.timeout_s))
        self.async_group = dist.new_group(backend=host, timeout=slow, group_desc="ckpt_async")
        self.async_ranks = RankAgreement(self.rank, self.world, self.async_group)
        self._candidates: list[str] | None = None  # resume=auto's, listed by will_load()
        # one run per directory; a no-op when train.main already holds the lock
        self.run_lock = claim_run_dir(cfg, self.rank, self.world, self.ctl_group)
        # train.memory_checkpoint_interval: copies in /dev/shm and at a peer (memory.py)
        self.memory, self.memory_plan = None, None
        if t.memory_checkpoint_interval > 0 and host != "fake":
            self.memory = MemoryCheckpoints(cfg, self.rank, self.world, self.ranks, self.ctl_group)

    def say(self, msg: str) -> None:
        """A checkpoint message, printed once (rank 0)."""
        if self.rank == 0:
            print(f"[checkpoint] {msg}", flush=True)

    def will_load(self) -> bool:
        """Whether resume will load weights (or raise): a checkpoint to resume exists, or
        train.resume / train.init_from names one (collective). Lets the model skip its
        random init when a checkpoint will fill it."""
        t = self.cfg.train
        if t.resume == "auto" and self.memory is not None:
            self.memory_plan = self.memory.plan()  # the newest complete in-memory step
        if t.resume == "auto":
            self._candidates = self.ranks.from_rank0(lambda: files.auto_candidates(self.path))
            if self._candidates or self.memory_plan is not None:
                return True
        return t.resume not in ("auto", "none") or t.init_from is not None

    def candidates(self) -> list[str]:
        """resume=auto's checkpoints, newest first: those will_load() listed, else listed now
        on rank 0 (collective)."""
        if self._candidates is None:  # will_load() did not list them
            return self.ranks.from_rank0(lambda: files.auto_candidates(self.path))
        return self._candidates

    def release(self) -> None:
        """Release the run directory's lock (when this process took it here)."""
        if self.run_lock is not None:
            self.run_lock.release()
