"""Sharded checkpoints: DCP save/load with resharding, a parallel exchange on load, checksums,
a safe reader of DCP's pickled metadata and the run directory's lock."""

from megatron_lite.checkpoint.checkpointer import Checkpointer
from megatron_lite.checkpoint.errors import CheckpointError, CheckpointReadError

__all__ = ["Checkpointer", "CheckpointError", "CheckpointReadError"]
