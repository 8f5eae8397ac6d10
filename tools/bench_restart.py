"""Restart time from an in-memory checkpoint (train.memory_checkpoint_interval) against the disk
checkpoint of the same step, on the real Trainer.

    python tools/bench_restart.py                 # the quickstart layout (8 ranks) and ~100M
    python tools/bench_restart.py --case 100m --rounds 3

Each case trains `--steps` steps on mock tokens with a disk checkpoint and an in-memory copy
after the last one, then leaves the copies as a killed group would and builds the Trainer again
as a restarted group does (TORCHELASTIC_RESTART_COUNT=1): once resuming from the in-memory
copies and once from disk (memory checkpoints off), alternating for `--rounds` rounds. Printed
per source, the median over rounds of rank 0's wall time of the whole Trainer construction
(process groups, model, resume) and of the resume alone, and rank 0's process CPU time of the
resume; with the save costs (memckpt_s, ckpt_blocked_s) and the bytes per rank.

The disk checkpoint was just written, so its files are in the page cache: "disk" here is the
best case of a local disk, not a cluster file system after a node was lost. torchrun's own
restart (about 9 s of process start-up on 2 cores here) comes on top of both.
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
CASES = {
    # the quickstart's model and layout (tp2 pp2 dp2, ZeRO-1), mock tokens of its vocabulary
    "quickstart": (8, ["--config", QUICKSTART, "data.mock=true", "model.vocab_size=4096"]),
    # ~110M parameters (GPT-2-small sized Llama), tp2 on two ranks
    "100m": (
        2,
        [
            "model.arch=llama",
            "model.num_layers=12",
            "model.hidden_size=768",
            "model.num_attention_heads=12",
            "model.num_query_groups=4",
            "model.ffn_hidden_size=2048",
            "model.seq_length=128",
            "model.vocab_size=32000",
            "model.tie_embeddings=true",
            "parallel.tp=2",
            "data.mock=true",
            "train.micro_batch_size=1",
            "train.global_batch_size=2",
        ],
    ),
}


def _build(overrides: list[str], world: int, restart: int):
    """A Trainer as a (restarted) group builds it -> (trainer, seconds, resume seconds, resume
    CPU seconds)."""
    from megatron_lite.checkpoint import Checkpointer
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    cfg, dataset, vocab = prepare(overrides, world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    timing = {}
    resume = Checkpointer.resume

    def timed(self):
        t0, c0 = time.perf_counter(), time.process_time()
        out = resume(self)
        timing.update(s=time.perf_counter() - t0, cpu=time.process_time() - c0)
        return out

    Checkpointer.resume = timed
    t0 = time.perf_counter()
    try:
        trainer = Trainer(cfg, mesh, dataset, vocab)
    finally:
        Checkpointer.resume = resume
    return trainer, time.perf_counter() - t0, timing["s"], timing["cpu"]


def bench_rank(rank: int, world: int, overrides: list[str], a) -> dict | None:
    """One rank of a case (its process group started by the shared launcher): rank 0's
    results."""
    import shutil

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    # train.steps one past the last step trained: the copy is made there (not at a clean end)
    base = [*overrides, f"train.steps={a.steps + 1}", f"train.save_interval={a.steps}"]
    base += [f"train.out_dir={a.out_dir}", "log.progress=false", "log.memory_steps=0"]
    memory = [*base, f"train.memory_checkpoint_interval={a.steps}"]
    trainer = _build(memory, world, restart=0)[0]
    trainer.signals.install()
    saves = {}
    while trainer.step < a.steps:  # as train() does, stopping where a killed group would
        record = trainer.train_step()
        trainer.signals.after_step(record, trainer.step, trainer.consumed_samples, False)
        saves = {k: record[k] for k in ("memckpt_s", "ckpt_blocked_s") if k in record}
    trainer.signals.restore()
    trainer.checkpointer.directory.release()
    memdir = trainer.checkpointer.memory.dir
    copy = os.path.join(memdir, f"rank{rank}-step{a.steps}.bin")
    results = {"memory": [], "disk": [], "saves": saves, "bytes": os.path.getsize(copy)}
    del trainer
    for _ in range(a.rounds):
        for source, cfg in (("memory", memory), ("disk", base)):
            t, total, resume_s, cpu = _build(cfg, world, restart=1)
            assert t.step == a.steps, f"{source}: resumed at step {t.step}"
            t.checkpointer.directory.release()
            results[source].append((total, resume_s, cpu))
            del t
    dist.barrier()
    if rank == 0:
        shutil.rmtree(memdir, ignore_errors=True)
    return results


def run_case(name: str, a) -> dict:
    """Run one case on its ranks (spawned by the benchmarks' shared launcher,
    bench_context_parallel.spawn) -> rank 0's results."""
    from tools.bench_context_parallel import spawn

    world, overrides = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        a.out_dir = os.path.join(tmp, "run")
        return spawn(world, bench_rank, overrides, a, timeout=a.timeout)


def report(name: str, res: dict) -> None:
    mib = res["bytes"] / 2**20
    saves = ", ".join(f"{k} {v:.3f}s" for k, v in res["saves"].items())
    print(f"{name}: {mib:.1f} MiB per rank (rank 0's copy); the step's saves: {saves}")
    for source in ("memory", "disk"):
        rows = res[source]
        total, resume_s, cpu = (statistics.median(r[i] for r in rows) for i in range(3))
        print(
            f"  restart from {source:6s}: Trainer built in {total:6.2f}s, resume {resume_s:6.3f}s "
            f"wall, {cpu:6.3f}s CPU (rank 0, median of {len(rows)})"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=[*CASES, "all"], default="all")
    p.add_argument("--steps", type=int, default=2, help="steps trained before the restart")
    p.add_argument("--rounds", type=int, default=3, help="restarts from each source")
    p.add_argument("--timeout", type=float, default=1800.0)
    a = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for name in CASES if a.case == "all" else [a.case]:
        report(name, run_case(name, a))


if __name__ == "__main__":
    main()
