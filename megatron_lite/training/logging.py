"""Rank-0 console progress, metrics.jsonl (one object per optimizer step) and optional wandb."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from megatron_lite.atomic import write_atomic
from megatron_lite.checkpoint.run_dir import new_aside_dir
from megatron_lite.config import Config


def read_records(path: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """metrics.jsonl -> ([(step, line)] of whole records, [(line number, text)] of lines that
    are not: a torn last line after a crash, or damage)."""
    records, bad = [], []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue
            try:
                step = json.loads(text)["step"]
                if not isinstance(step, int):
                    raise TypeError(step)
            except (ValueError, KeyError, TypeError):
                bad.append((i, text.rstrip("\n")))
                continue
            records.append((step, text if text.endswith("\n") else text + "\n"))
    return records, bad


def _warn(msg: str) -> None:
    print(f"[metrics] warning: {msg}", file=sys.stderr, flush=True)


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def reports_at(step: int, cfg: Config) -> bool:
    """Whether (0-based) `step` ends a progress interval: every log.interval steps and the
    last step of the run."""
    done = step + 1
    return done % cfg.log.interval == 0 or done == cfg.train.steps


class MetricsLogger:
    """Writes `<out_dir>/metrics.jsonl` (every step) and prints a progress line every
    `log.interval` steps with means over the interval; only active on rank 0."""

    def __init__(self, cfg: Config, active: bool):
        self.cfg, self.active = cfg, active
        self.start = time.monotonic()
        self.window: list[dict] = []  # records since the last progress line
        self.wandb = None
        self.file = None
        self.error: OSError | None = None  # a failed write of metrics.jsonl (rank 0)
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
        resume from an earlier checkpoint), so each step appears once. A torn last line (the
        run died mid-write) is dropped with a warning; a run that starts from step 0 moves
        an earlier run's records aside (never truncates them)."""
        path = os.path.join(self.cfg.train.out_dir, "metrics.jsonl")
        if os.path.exists(path):
            records, torn = read_records(path)
            for line_no, text in torn:
                _warn(f"{path} line {line_no} is not a whole record, dropped: {text[:80]!r}")
            if first_step == 0 and records:
                aside = new_aside_dir(self.cfg.train.out_dir)
                os.replace(path, os.path.join(aside, "metrics.jsonl"))
                print(f"[metrics] this run starts at step 0: moved the earlier {path} to {aside}/")
            else:
                keep = [line for step, line in records if step < first_step]
                write_atomic(path, "".join(keep))
        self.file = open(path, "a")

    def log(self, record: dict, first_step: int) -> None:
        if not self.active:
            return
        if self.error is None:
            self._write(record, first_step)
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        self.window.append(record)
        if self.cfg.log.progress and reports_at(record["step"], self.cfg):
            self._print(record["step"] + 1, self.cfg.train.steps, first_step)
            self.window = []

    def _write(self, record: dict, first_step: int) -> None:
        """Append the record; a failed write (a full disk) is kept in `error`, naming the
        file, and ends the writing: the trainer stops the run at the next step (trainer.py)."""
        path = os.path.join(self.cfg.train.out_dir, "metrics.jsonl")
        try:
            if self.file is None:
                self._open(first_step)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            self.error = OSError(e.errno, e.strerror, e.filename or path)
            if self.file is not None:
                with contextlib.suppress(OSError):  # its buffer cannot be written either
                    self.file.close()
                self.file = None

    def _print(self, step: int, total: int, first_step: int) -> None:
        """One progress line; loss, grad norm and throughput are means over the interval."""
        w = self.window

        def mean(key: str) -> float:
            return sum(r[key] for r in w) / len(w)

        eta = (time.monotonic() - self.start) / max(step - first_step, 1) * (total - step)
        extra = "".join(f" | {k} {mean(k):.4g}" for k in ("aux_loss",) if k in w[-1])
        if "tflops_per_rank" in w[-1]:  # model TFLOP/s per rank (MFU on a known GPU)
            extra += f" | {mean('tflops_per_rank'):.3g} TFLOP/s/rank"
            if "mfu" in w[-1]:
                extra += f" | MFU {mean('mfu'):.1%}"
        if "eval_loss" in w[-1]:  # the last evaluation of the interval, not a mean
            extra += f" | eval loss {w[-1]['eval_loss']:.4f}"
        print(
            f"step {step:5d}/{total} | loss {mean('loss'):.4f} | lr {w[-1]['lr']:.3e} | "
            f"grad norm {mean('grad_norm'):.3f} | {mean('tokens_per_s'):,.0f} tok/s | "
            f"{mean('step_time_s') * 1000:.0f} ms/step{extra} | ETA {_fmt_time(eta)}",
            file=sys.stdout,
            flush=True,
        )

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError as e:  # the last records' flush
                self.error = self.error or OSError(e.errno, e.strerror, self.file.name)
        if self.wandb is not None:
            self.wandb.finish()
