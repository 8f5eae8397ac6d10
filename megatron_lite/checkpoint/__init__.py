"""Sharded checkpoints, built from the config, the mesh, the model chunks, the data-parallel
wrapper and the RNG tracker (no Trainer): DCP save/load with resharding, a parallel exchange
on load, checksums, a safe reader of DCP's pickled metadata and the run directory's lock.
Never imports training/ or plan/; when to save and when to stop is the trainer's policy."""

from megatron_lite.checkpoint.checkpointer import Checkpointer
from megatron_lite.checkpoint.directory import CheckpointDir
from megatron_lite.checkpoint.errors import CheckpointError, CheckpointReadError

__all__ = ["CheckpointDir", "CheckpointError", "CheckpointReadError", "Checkpointer"]
