"""Rank-0 console progress, metrics.jsonl (one object per optimizer step) and optional wandb."""

from __future__ import annotations

import json
import os
import sys
import time

from megatron_lite.atomic import write_atomic
from megatron_lite.config import Config


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Writes `<out_dir>/metrics.jsonl` (every step) and prints a progress line every
    `log.interval` steps with means over the interval; only active on rank 0."""

    def __init__(self, cfg: Config, active: bool):
        self.cfg, self.active = cfg, active
        self.start = time.monotonic()
        self.window: list[dict] = []  # records since the last progress line
        self.wandb = None
        self.file = None
        if not active:
            return
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        if cfg.log.wandb and cfg.log.wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=cfg.log.wandb_project,
                mode=cfg.log.wandb_mode,
                dir=cfg.train.out_dir,
                config=cfg.to_dict(),
            )

    def _open(self, first_step: int) -> None:
        """Append to metrics.jsonl, first dropping records of steps this run will redo (a
        resume from an earlier checkpoint), so each step appears once."""
        path = os.path.join(self.cfg.train.out_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                keep = [
                    line for line in f if line.strip() and json.loads(line)["step"] < first_step
                ]
            write_atomic(path, "".join(keep))
        self.file = open(path, "a")

    def log(self, record: dict, first_step: int) -> None:
        if not self.active:
            return
        if self.file is None:
            self._open(first_step)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        self.window.append(record)
        step, total = record["step"] + 1, self.cfg.train.steps
        if self.cfg.log.progress and (step % self.cfg.log.interval == 0 or step == total):
            self._print(step, total, first_step)
            self.window = []

    def _print(self, step: int, total: int, first_step: int) -> None:
        """One progress line; loss, grad norm and throughput are means over the interval."""
        w = self.window

        def mean(key: str) -> float:
            return sum(r[key] for r in w) / len(w)

        eta = (time.monotonic() - self.start) / max(step - first_step, 1) * (total - step)
        extra = "".join(f" | {k} {mean(k):.4g}" for k in ("aux_loss",) if k in w[-1])
        print(
            f"step {step:5d}/{total} | loss {mean('loss'):.4f} | lr {w[-1]['lr']:.3e} | "
            f"grad norm {mean('grad_norm'):.3f} | {mean('tokens_per_s'):,.0f} tok/s | "
            f"{mean('step_time_s') * 1000:.0f} ms/step{extra} | ETA {_fmt_time(eta)}",
            file=sys.stdout,
            flush=True,
        )

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
