"""Rules of in-memory checkpoints (train.memory_checkpoint_interval, checkpoint/memory.py)."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.validation.rules import _rule

KEY = "train.memory_checkpoint_interval"


def _validate_memory_checkpoints(cfg: Config, world_size: int) -> None:
    """The interval is a step count (0 = off), and a copy needs a peer rank to replicate to:
    one rank alone has none (its own copy would not survive losing its node)."""
    every = cfg.train.memory_checkpoint_interval
    _rule(every >= 0, KEY, every, "must be >= 0", "use 0 (off) or a step count, e.g. 50")
    _rule(
        every == 0 or world_size >= 2,
        KEY,
        every,
        f"needs a peer rank to hold each rank's replica, and this run has {world_size} rank",
        f"run on 2 or more ranks, or set {KEY}=0 (use train.save_interval on one rank)",
    )
