"""Stop signals and the checkpoint policy at each step boundary: save when due, stop when
signalled.

SIGTERM and SIGUSR1 (Slurm's warning before preemption), and SIGINT (Ctrl-C) like SIGTERM,
stop training cleanly at the next step boundary. A handler only records the signal
(`StopSignals.received`); the trainer folds "this rank got one" into its one per-step world
all-reduce, so every rank learns of it at the same step without a collective of its own, and
passes the agreed flag to `after_step`, which saves (when train.save_interval > 0) and says
why the run stops. Without a signal, `after_step` saves every train.save_interval steps and
after the last step.
"""

from __future__ import annotations

import signal
import threading

import torch.distributed as dist

from megatron_lite.checkpoint import Checkpointer

__all__ = ["SIGNALS", "StopSignals"]
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # SIGINT (Ctrl-C) as SIGTERM


class StopSignals:
    """The stop-signal handlers of one training run and what each step boundary does about
    them and about the saves that are due (`checkpointer.save`)."""

    def __init__(self, checkpointer: Checkpointer, train) -> None:
        self.checkpointer, self.train = checkpointer, train  # train: the TrainConfig
        self.received: str | None = None  # the last stop signal this rank got, by name
        self._old_handlers: dict = {}

    def install(self) -> None:
        """Install the SIGTERM / SIGUSR1 / SIGINT handlers (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        """Put back the handlers install() replaced."""
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def after_step(
        self, record: dict, step: int, consumed_samples: int, stop: bool, why: str | None = None
    ) -> bool:
        """Save when due (adds ckpt_blocked_s to the record); True = stop training now.
        `step`: optimizer steps done, `consumed_samples`: the data position; `stop`: whether
        any rank got a stop signal, already agreed by the caller (the trainer folds the flag
        into its one per-step world all-reduce); `why`: the stop's reason other than a
        signal, if this rank knows one."""
        t = self.train
        due = t.save_interval > 0 and (step % t.save_interval == 0 or step == t.steps)
        if due or (stop and t.save_interval > 0):
            record["ckpt_blocked_s"] = self.checkpointer.save(step, consumed_samples)
        every = t.memory_checkpoint_interval  # a copy in host memory (checkpoint/memory.py)
        if every > 0 and step % every == 0 and step < t.steps and not stop:
            record["memckpt_s"] = self.checkpointer.save_memory(step, consumed_samples)
        if stop:
            self.checkpointer.wait()
            cause = f"received {self.received}" if self.received else why
            cause = cause or "received a signal on another rank"
            saved = f"checkpoint saved at step {step}"
            if t.save_interval == 0:
                saved = "no checkpoint saved (train.save_interval=0)"
            if dist.get_rank() == 0:
                print(f"[checkpoint] {cause}: {saved}; stopping cleanly", flush=True)
        return stop
