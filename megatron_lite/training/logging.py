"""Rank-0 console progress and the metrics records (one per optimizer step) in their sinks:
metrics.jsonl, and optionally wandb and TensorBoard (training/tensorboard.py)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Protocol

from megatron_lite.atomic import write_atomic
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


def _straggler_text(record: dict) -> str:
    """The progress line's part for a straggler report (training/straggler.py): the slowest
    rank, its host and its speed relative to its peers' median."""
    s = record["straggler/slowest_ranks"][0]
    return f" | slowest rank {s['rank']} ({s['host']}) {s['rel']:.2f}x"


def reports_at(step: int, cfg: Config) -> bool:
    """Whether (0-based) `step` ends a progress interval: every log.interval steps and the
    last step of the run."""
    done = step + 1
    return done % cfg.log.interval == 0 or done == cfg.train.steps


class Sink(Protocol):
    """A destination of the metrics records. `write` gets every record of the run in step
    order, with the step the run started at (a file sink drops what an earlier run logged for
    the steps this run redoes); a failed file write raises OSError."""

    path: str  # what a failure names

    def write(self, record: dict, first_step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """`<out_dir>/metrics.jsonl`: one JSON line per record, flushed at once (a crash keeps every
    step logged so far)."""

    def __init__(self, out_dir: str):
        self.out_dir, self.path = out_dir, os.path.join(out_dir, "metrics.jsonl")
        self.file = None

    def _open(self, first_step: int) -> None:
        """Append to metrics.jsonl, first dropping records of steps this run will redo (a
        resume from an earlier checkpoint), so each step appears once. A torn last line (the
        run died mid-write) is dropped with a warning; a run that starts from step 0 moves
        an earlier run's records aside (never truncates them)."""
        path = self.path
        if os.path.exists(path):
            records, torn = read_records(path)
            for line_no, text in torn:
                _warn(f"{path} line {line_no} is not a whole record, dropped: {text[:80]!r}")
            if first_step == 0 and records:
                # imported here: read_records serves tools/plot_run.py, which needs no torch
                from megatron_lite.checkpoint.run_dir import new_aside_dir

                aside = new_aside_dir(self.out_dir)
                os.replace(path, os.path.join(aside, "metrics.jsonl"))
                print(f"[metrics] this run starts at step 0: moved the earlier {path} to {aside}/")
            else:
                keep = [line for step, line in records if step < first_step]
                write_atomic(path, "".join(keep))
        self.file = open(path, "a")

    def write(self, record: dict, first_step: int) -> None:
        try:
            if self.file is None:
                self._open(first_step)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError:
            if self.file is not None:
                with contextlib.suppress(OSError):  # its buffer cannot be written either
                    self.file.close()
                self.file = None
            raise

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            file.close()  # the last records' flush may fail: MetricsLogger names the file


class WandbSink:
    """A wandb run (log.wandb): each record logged at its step."""

    def __init__(self, cfg: Config):
        import wandb

        self.path = cfg.train.out_dir
        self.run = wandb.init(
            project=cfg.log.wandb_project,
            mode=cfg.log.wandb_mode,
            dir=cfg.train.out_dir,
            config=cfg.to_dict(),
        )

    def write(self, record: dict, first_step: int) -> None:
        self.run.log(record, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def build_sinks(cfg: Config) -> list[Sink]:
    """Every destination of the metrics records this config asks for: metrics.jsonl always,
    wandb (log.wandb) and TensorBoard (log.tensorboard)."""
    sinks: list[Sink] = [JsonlSink(cfg.train.out_dir)]
    if cfg.log.wandb and cfg.log.wandb_mode != "disabled":
        sinks.append(WandbSink(cfg))
    if cfg.log.tensorboard:
        from megatron_lite.training.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(cfg.log.tensorboard_path(cfg.train.out_dir)))
    return sinks


class MetricsLogger:
    """Hands each step's record to every sink (build_sinks: metrics.jsonl, wandb, TensorBoard),
    the same dict to each, so they cannot disagree, and prints a progress line every
    `log.interval` steps with means over the interval; only active on rank 0."""

    def __init__(self, cfg: Config, active: bool):
        self.cfg, self.active = cfg, active
        self.start = time.monotonic()
        self.window: list[dict] = []  # records since the last progress line
        self.sinks: list[Sink] = []
        self.failed: list[Sink] = []  # sinks whose write failed: not written again
        self.error: OSError | None = None  # the first failed write of a file sink (rank 0)
        if not active:
            return
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        self.sinks = build_sinks(cfg)

    def log(self, record: dict, first_step: int) -> None:
        if not self.active:
            return
        for sink in self.sinks:
            if sink not in self.failed:
                self._guarded(sink.write, sink, record, first_step)
        self.window.append(record)
        if self.cfg.log.progress and reports_at(record["step"], self.cfg):
            self._print(record["step"] + 1, self.cfg.train.steps, first_step)
            self.window = []

    def _guarded(self, call, sink, *args) -> None:
        """A failed write (a full disk) is kept in `error`, naming the file, and ends that
        sink's writing: the trainer stops the run at the next step (trainer.py)."""
        try:
            call(*args)
        except OSError as e:
            self.failed.append(sink)
            self.error = self.error or OSError(e.errno, e.strerror, e.filename or sink.path)

    def _print(self, step: int, total: int, first_step: int) -> None:
        """One progress line; loss, grad norm and throughput are means over the interval."""
        w = self.window

        def mean(key: str) -> float:
            return sum(r[key] for r in w) / len(w)

        eta = (time.monotonic() - self.start) / max(step - first_step, 1) * (total - step)
        extra = "".join(f" | {k} {mean(k):.4g}" for k in ("aux_loss", "mtp_loss") if k in w[-1])
        if "tflops_per_rank" in w[-1]:  # model TFLOP/s per rank (MFU on a known GPU)
            extra += f" | {mean('tflops_per_rank'):.3g} TFLOP/s/rank"
            if "mfu" in w[-1]:
                extra += f" | MFU {mean('mfu'):.1%}"
        if "eval_loss" in w[-1]:  # the last evaluation of the interval, not a mean
            extra += f" | eval loss {w[-1]['eval_loss']:.4f}"
        reports = [r for r in w if "straggler/slowest_ranks" in r]
        if reports:  # the interval's last straggler report
            extra += _straggler_text(reports[-1])
        print(
            f"step {step:5d}/{total} | loss {mean('loss'):.4f} | lr {w[-1]['lr']:.3e} | "
            f"grad norm {mean('grad_norm'):.3f} | {mean('tokens_per_s'):,.0f} tok/s | "
            f"{mean('step_time_s') * 1000:.0f} ms/step{extra} | ETA {_fmt_time(eta)}",
            file=sys.stdout,
            flush=True,
        )

    def close(self) -> None:
        for sink in self.sinks:
            if sink not in self.failed:
                self._guarded(sink.close, sink)
