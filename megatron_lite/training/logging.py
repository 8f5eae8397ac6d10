"""Rank-0 console progress, metrics.jsonl (one object per optimizer step) and optional wandb."""

from __future__ import annotations

import json
import os
import sys
import time

from megatron_lite.config import Config


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Writes `<out_dir>/metrics.jsonl` and prints a progress line; only active on rank 0."""

    def __init__(self, cfg: Config, active: bool):
        self.cfg, self.active = cfg, active
        self.start = time.monotonic()
        self.wandb = None
        self.file = None
        if not active:
            return
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        self.file = open(os.path.join(cfg.train.out_dir, "metrics.jsonl"), "a")
        if cfg.log.wandb and cfg.log.wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=cfg.log.wandb_project,
                mode=cfg.log.wandb_mode,
                dir=cfg.train.out_dir,
                config=cfg.to_dict(),
            )

    def log(self, record: dict, first_step: int) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        step, total = record["step"] + 1, self.cfg.train.steps
        if self.cfg.log.progress and (step % self.cfg.log.interval == 0 or step == total):
            done = step - first_step
            eta = (time.monotonic() - self.start) / max(done, 1) * (total - step)
            extra = "".join(f" | {k} {record[k]:.4g}" for k in ("aux_loss",) if k in record)
            print(
                f"step {step:5d}/{total} | loss {record['loss']:.4f} | lr {record['lr']:.3e} | "
                f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"{record['step_time_s'] * 1000:.0f} ms/step{extra} | ETA "
                f"{_fmt_time(eta)}",
                file=sys.stdout,
                flush=True,
            )

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
