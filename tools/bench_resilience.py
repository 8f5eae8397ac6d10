"""What straggler detection and the rerun bookkeeping cost (docs/resilience.md): the quickstart's
layout and model (configs/quickstart.yaml: tp=2, pp=2, dp=2 on 8 ranks, 4M parameters; mock
tokens instead of the corpus, no evaluation, no checkpoint) trained with both features on
(log.straggler=true, train.rerun_on=both) and off in turn, step by step, in one run: one
trainer per rank, built with both on, whose odd steps run with them and even steps without.

    python tools/bench_resilience.py                     # 22 steps, 8 ranks
    python tools/bench_resilience.py --steps 6 --world 2  # dp=2 only: a quick check

Two figures, both in CPU time (the machine may be shared: another process's load does not
count, and a rank waiting in a gloo collective burns almost none, see training/straggler.py):
- the A/B overhead: per rank, each on step's process CPU seconds over the off step's before
  it; the median of these ratios over ranks and pairs, minus 1 (adjacent steps: a drift of
  the machine's state cancels; the first WARMUP steps are not counted). At a true cost far
  below 1% this figure is the noise's.
- the bookkeeping itself: the thread CPU time spent inside the features' per-step calls
  (StragglerDetector.start/stop/report, StepRerun.capture/check/metrics; no step triggers a
  replay here), per step, over the step's CPU time with the features off. This is the cost,
  measured directly; the A/B figure bounds what it misses (cache effects).
Both must be at most --budget (2%, issue #44).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
WARMUP = 2  # steps of each trainer not counted (allocations, first optimizer states)
MOCK = ["data.corpus=null", "data.mock=true", "model.vocab_size=4096"]
QUIET = ["train.eval_interval=0", "train.save_interval=0", "log.progress=false"]
ON = ["log.straggler=true", "train.rerun_on=both"]


def _accounted(spent: list[float], fn):
    """fn, adding its thread CPU time to spent[0]."""

    def run(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t0

    return run


def _instrument(trainer, spent: list[float]) -> None:
    """Wrap every per-step call of the two features (this trainer's objects only)."""
    if trainer.straggler is not None:
        s = trainer.straggler
        for name in ("start", "stop", "report"):
            setattr(s, name, _accounted(spent, getattr(s, name)))
    r = trainer.rerun
    for name in ("capture", "check", "metrics"):
        setattr(r, name, _accounted(spent, getattr(r, name)))


def _steps(rank, world, a, out_dir) -> tuple[list[float], list[float], list[float]]:
    """One trainer built with both features on, stepped with them on and off in turn ->
    (process CPU s of each counted off step, of each on step, bookkeeping CPU s per on step)."""
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    args = [*MOCK, *QUIET, *ON, f"train.out_dir={out_dir}", f"train.steps={a.steps}"]
    args += [f"log.straggler_interval={a.interval}"]
    if world != 8:
        args += ["parallel.tp=1", "parallel.pp=1"]  # --world 2: dp=2 (the quick check)
    cfg, dataset, vocab = prepare(["--config", QUICKSTART, *args], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)
    spent = [0.0]
    _instrument(trainer, spent)
    detector, rerun = trainer.straggler, trainer.stepper.rerun
    off, on, book = [], [], []
    for step in range(a.steps):
        odd = step % 2 == 1  # on: odd steps (the reports at steps interval-1, 2·interval-1...)
        trainer.straggler, trainer.stepper.rerun = (detector, rerun) if odd else (None, None)
        before, t0 = spent[0], time.process_time()
        trainer.train_step()
        if step >= WARMUP:
            (on if odd else off).append(time.process_time() - t0)
            if odd:
                book.append(spent[0] - before)
    trainer.checkpointer.finish()
    trainer.logger.close()
    if rank == 0 and rerun.counts["replays"]:
        print(f"[bench] replays: {rerun.messages}", flush=True)
    return off, on, book


def _rank(rank, world, a, out_dir):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MEGATRON_LITE_QUIET", "1")
    torch.set_num_threads(1)
    everyone = [None] * world
    dist.all_gather_object(everyone, _steps(rank, world, a, out_dir))
    return everyone


def spawn(a) -> list:
    """Every rank's (off, on, bookkeeping) lists, from `a.world` spawned gloo ranks (the
    benchmarks' shared launcher, bench_context_parallel.spawn)."""
    from tools.bench_context_parallel import spawn as spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        return spawn_ranks(a.world, _rank, a, tmp, timeout=a.timeout)


def summarize(everyone: list, budget: float) -> tuple[dict, list[str]]:
    """The figures (module docstring) and their report lines."""
    off = [t for o, _, _ in everyone for t in o]
    on = [t for _, n, _ in everyone for t in n]
    book = [s for _, _, b in everyone for s in b]
    base = statistics.median(off)
    # each on step against the off step before it (same rank): drift cancels
    pairs = [n / o for o_, n_, _ in everyone for o, n in zip(o_, n_, strict=False)]
    ab = statistics.median(pairs) - 1
    direct = statistics.mean(book) / base
    lines = [
        f"process CPU s/step (median over ranks and steps): off {base * 1000:.2f} ms, "
        f"on {statistics.median(on) * 1000:.2f} ms ({len(off)} and {len(on)} rank-steps)",
        f"A/B overhead (median of on/off over adjacent step pairs): {ab:+.2%}",
        f"bookkeeping (thread CPU inside the features' calls, mean): "
        f"{statistics.mean(book) * 1e6:.0f} us/step = {direct:.3%} of the step",
        f"budget {budget:.0%}: {'ok' if max(ab, direct) <= budget else 'OVER'}",
    ]
    return {"off_s": base, "ab": ab, "direct": direct}, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps", type=int, default=22, help="steps, off and on in turn (first 2 not counted)"
    )
    p.add_argument("--world", type=int, default=8, choices=(2, 8), help="8: the quickstart")
    p.add_argument("--interval", type=int, default=10, help="log.straggler_interval")
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args(argv)
    if a.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps, got {a.steps}")
    _, lines = summarize(spawn(a), a.budget)
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
