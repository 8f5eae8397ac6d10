"""TensorBoard sink of the metrics records (log.tensorboard=true): every numeric field of a
metrics.jsonl record as a scalar of the same name at the record's step, written by the rank that
writes metrics.jsonl (training/logging.py hands both the same record).

Resume: the writer starts with TensorBoard's purge_step at the step this run starts from, so a
reader drops what an earlier run logged for the steps this run redoes (as metrics.jsonl drops
their records); a run that starts at step 0 moves an earlier run's event files into
`<tensorboard dir>/overwritten-<time>/` instead, where TensorBoard shows them as a run of their
own. The tensorboard package is an optional extra; validation (validation/log.py) refuses
log.tensorboard=true without it.
"""

from __future__ import annotations

import os

from megatron_lite.checkpoint.run_dir import new_aside_dir

EVENT_FILE_PREFIX = "events.out.tfevents."  # the name of every TensorBoard event file


def scalars(record: dict) -> dict[str, float]:
    """The record's numeric fields but its step, as floats (a bool, `skipped`, as 0/1)."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, int | float)}


def event_files(log_dir: str) -> list[str]:
    """The TensorBoard event files directly in `log_dir` (not its subdirectories), sorted."""
    if not os.path.isdir(log_dir):
        return []
    return sorted(n for n in os.listdir(log_dir) if n.startswith(EVENT_FILE_PREFIX))


class TensorBoardSink:
    """Writes each record's scalars (`scalars`) into `log_dir` at the record's step; flushed
    after every record, as metrics.jsonl is, so a crash loses neither."""

    def __init__(self, log_dir: str):
        self.path = log_dir
        self.writer = None  # opened at the first record, which says where the run starts

    def _open(self, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        earlier = event_files(self.path)
        if first_step == 0 and earlier:
            aside = new_aside_dir(self.path)
            for name in earlier:
                os.replace(os.path.join(self.path, name), os.path.join(aside, name))
            print(f"[metrics] this run starts at step 0: moved the earlier event files to {aside}/")
        # purge_step: readers drop the earlier events at steps >= first_step (a resume)
        return SummaryWriter(self.path, purge_step=first_step)

    def write(self, record: dict, first_step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self.writer is None:
            self.writer = self._open(first_step)
        # one event holding every scalar of the step, as add_scalar would write them one by
        # one (simple_value: float32), at a tenth of add_scalar's cost per field
        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars(record).items()]
        self.writer.file_writer.add_summary(Summary(value=values), record["step"])
        self.writer.flush()  # raises a failed write (the writer's thread keeps it)

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()
