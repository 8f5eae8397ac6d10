"""The checkpoint errors, each raised the same way on every rank (see rank_agreement.py)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and says what to do."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code when loaded (see dcp_metadata.py): never skipped
    over, always reported."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions, I/O); the previous one is intact."""


class CheckpointReadError(RuntimeError):
    """Reading checkpoints failed for another reason than damage (I/O, permissions): resume
    stops here rather than fall back to an older checkpoint or to a fresh start."""


class RunDirError(CheckpointError):
    """The run directory is in use, its lock file is damaged, or it holds checkpoints this
    run would clobber."""
