"""Plot one or more training runs from their metrics.jsonl into one PNG.

    python tools/plot_run.py runs/quickstart --out docs/quickstart_run.png
    python tools/plot_run.py runs/a runs/b --label baseline --label "lr 1e-3"

Panels: the training loss (and the validation loss, eval_loss, where it was evaluated) against
the step and against the tokens trained (consumed_samples times the run's model.seq_length, read
from the config.yaml the run wrote beside its metrics), throughput (tokens_per_s), the gradient
norm, the learning rate and the peak memory per rank (mem/allocated_peak on a GPU, else the
tracked step peak mem/step_peak). Several runs are overlaid, one colour each, named by their
directory (or --label). A record that is not whole (a crash mid-write) is skipped with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import yaml

from megatron_lite.training.logging import read_records

MEMORY_FIELDS = ("mem/allocated_peak", "mem/step_peak")  # the first one a run has
MIB = 2**20


class RunError(ValueError):
    """A run directory that cannot be plotted; the message names it and says why."""


@dataclasses.dataclass
class Run:
    """One run's records (metrics.jsonl, in file order) and what the tokens axis needs."""

    name: str
    records: list[dict]
    seq_length: int

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x, y) of the records holding `key`; x is "step" or "tokens"."""
        rows = [r for r in self.records if key in r]
        if x == "tokens":
            xs = [r["consumed_samples"] * self.seq_length for r in rows]
        else:
            xs = [r["step"] for r in rows]
        return xs, [r[key] for r in rows]

    def memory_field(self) -> str | None:
        return next((k for k in MEMORY_FIELDS if any(k in r for r in self.records)), None)


def load_run(path: str, name: str | None = None) -> Run:
    """The run in directory `path` (its metrics.jsonl and config.yaml); RunError if missing."""
    if not os.path.isdir(path):
        raise RunError(f"{path}: no such directory. Fix: give a run's train.out_dir")
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise RunError(
            f"{path} has no metrics.jsonl, so it is not a run directory (or its run logged no "
            "step yet). Fix: give the train.out_dir of a run that trained at least one step"
        )
    records, bad = read_records(metrics)
    for line_no, text in bad:
        print(f"warning: {metrics} line {line_no} is not a whole record, skipped: {text[:60]!r}",
              file=sys.stderr)  # fmt: skip
    if not records:
        raise RunError(f"{metrics} holds no record. Fix: plot it once the run has logged a step")
    config = os.path.join(path, "config.yaml")
    try:
        with open(config) as f:
            seq_length = int(yaml.safe_load(f)["model"]["seq_length"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        raise RunError(
            f"{config}: cannot read model.seq_length ({type(e).__name__}: {e}), which the "
            "tokens axis needs. Fix: plot a run directory as the trainer wrote it (config.yaml "
            "beside metrics.jsonl)"
        ) from e
    rows = [json.loads(line) for _, line in records]
    return Run(name or os.path.basename(os.path.normpath(path)), rows, seq_length)


def _panel(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_runs(runs: list[Run]):
    """A matplotlib Figure of `runs` (module docstring); each line's label is its run's name
    ("<name> eval" for the validation loss), its data the metrics.jsonl values as they are
    (memory in MiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=80)
    (loss_step, loss_tokens, speed), (grad, lr, memory) = axes
    _panel(loss_step, "loss", "step", "loss")
    _panel(loss_tokens, "loss against tokens", "tokens trained", "loss")
    _panel(speed, "throughput", "step", "tokens/s")
    _panel(grad, "grad norm", "step", "grad norm (before clipping)")
    _panel(lr, "learning rate", "step", "lr")
    fields = sorted({f for f in (run.memory_field() for run in runs) if f})
    _panel(memory, "peak memory per rank", "step", f"MiB ({', '.join(fields) or 'none'})")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        for ax, x in ((loss_step, "step"), (loss_tokens, "tokens")):
            ax.plot(*run.series("loss", x), color=c, lw=1, label=run.name)
            ex, ey = run.series("eval_loss", x)
            if ex:
                ax.plot(ex, ey, color=c, ls="--", marker="o", ms=4, label=f"{run.name} eval")
        speed.plot(*run.series("tokens_per_s"), color=c, lw=1, label=run.name)
        grad.plot(*run.series("grad_norm"), color=c, lw=1, label=run.name)
        lr.plot(*run.series("lr"), color=c, lw=1, label=run.name)
        field = run.memory_field()
        if field is not None:
            mx, my = run.series(field)
            memory.plot(mx, [v / MIB for v in my], color=c, lw=1, label=run.name)
    memory.set_ylim(bottom=0)
    for ax in axes.flat:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Panels and axes: see the module docstring (python -m pydoc tools/plot_run.py).",
    )  # fmt: skip
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (train.out_dir)")
    p.add_argument("--out", default="run.png", help="the PNG to write (default: run.png)")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="a run's name in the legend, once per RUN in order (default: the directory names)",
    )
    args = p.parse_args(argv)
    if args.label and len(args.label) != len(args.runs):
        p.error(
            f"--label given {len(args.label)} time(s) for {len(args.runs)} run(s). Fix: one "
            "--label per RUN, in order, or none"
        )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    labels = args.label or [None] * len(args.runs)
    try:
        runs = [load_run(path, label) for path, label in zip(args.runs, labels, strict=True)]
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fig = plot_runs(runs)
    try:
        fig.savefig(args.out)
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    steps = ", ".join(f"{r.name}: {len(r.records)} steps" for r in runs)
    print(f"wrote {args.out} ({steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
