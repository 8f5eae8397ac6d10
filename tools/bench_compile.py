"""model.compile against eager: step time of the real trainer, compile time and graph breaks.

    python tools/bench_compile.py                  # one rank (4 layers, h1024) and quickstart
    python tools/bench_compile.py --cases one_rank --steps 8
    python tools/bench_compile.py --quick          # a tiny model on one rank (the unit test's)

Each case runs twice, eager and with model.compile=true, each in fresh processes (dynamo's state
is per process) on forked-free spawned ranks over gloo with a FileStore, --threads torch threads
per rank. The first step (where the regions compile) is timed alone; the step time is the median
over the next --steps steps, in wall time and in process CPU time summed over the ranks (other
jobs on the machine do not count in CPU time: use it where the wall clock is disturbed).
Cases: `one_rank`, issue #41's 4-layer h1024 Llama (16 heads, seq 256, micro batch 2) on one
rank; `quickstart`, configs/quickstart.yaml's model and layout (tp2+SP, pp2 1F1B, dp2 ZeRO-1 on
8 ranks) on mock data of its vocabulary size. Inductor's cache goes to --cache-dir (a second
run of this tool compiles from it: its first step shows the saving).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = {"one_rank": 0.85, "quickstart": 0.92}  # issue #41: compiled / eager step time
MOCK = ["data.mock=true", "train.eval_interval=0", "train.save_interval=0", "log.progress=false",
        "log.memory_steps=0"]  # fmt: skip
CASES = {
    "one_rank": (1, None, [
        "model.num_layers=4", "model.hidden_size=1024", "model.num_attention_heads=16",
        "model.seq_length=256", "model.vocab_size=4096", "train.micro_batch_size=2",
        "train.global_batch_size=2",
    ]),
    "quickstart": (8, "configs/quickstart.yaml", ["model.vocab_size=4096", "data.corpus=null"]),
    "quick": (1, None, [
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.seq_length=32", "model.vocab_size=256", "train.micro_batch_size=2",
        "train.global_batch_size=2",
    ]),
}  # fmt: skip


def _rank(rank: int, world: int, store: str, argv: list[str], steps: int, threads: int, queue):
    """One rank: the trainer's first step, then `steps` more, each timed (wall, CPU)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(argv, world_size=world)
    trainer = Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)
    times = []
    for _ in range(steps + 1):
        w, c = time.perf_counter(), time.process_time()
        trainer.train_step()
        times.append((time.perf_counter() - w, time.process_time() - c))
    report = None
    if cfg.model.compile:
        from megatron_lite.models.compile import compile_report

        report = compile_report()
    queue.put((rank, times, report))
    dist.destroy_process_group()


def run_case(name: str, compiled: bool, a: argparse.Namespace) -> dict:
    """One case, eager or compiled, on fresh spawned ranks -> its figures."""
    world, config, overrides = CASES[name]
    steps = a.steps
    with tempfile.TemporaryDirectory() as tmp:
        argv = ([] if config is None else ["--config", config]) + [
            *overrides, *MOCK, f"train.steps={steps + 1}", f"train.out_dir={tmp}/run",
            f"model.compile={str(compiled).lower()}",
        ]  # fmt: skip
        if compiled and a.mode:
            argv.append(f"model.compile_mode={a.mode}")
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        # inherited by the spawned ranks; one compile thread each (a worker pool per rank
        # oversubscribes a small machine)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        args = (world, f"{tmp}/store", argv, steps, a.threads, queue)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=a.timeout) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    first_wall = max(r[1][0][0] for r in results)
    walls = [max(r[1][k][0] for r in results) for k in range(1, steps + 1)]
    cpus = [sum(r[1][k][1] for r in results) for k in range(1, steps + 1)]
    return {
        "first_step_s": first_wall,
        "wall_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
        "report": results[0][2],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["one_rank", "quickstart"], choices=CASES)
    p.add_argument("--steps", type=int, default=6, help="timed steps after the first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--mode", default=None, help="model.compile_mode")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--cache-dir",
        default=os.path.join(tempfile.gettempdir(), "megatron_lite_inductor_bench"),
        help="TORCHINDUCTOR_CACHE_DIR",
    )
    p.add_argument("--quick", action="store_true", help="the tiny case, 2 timed steps")
    a = p.parse_args(argv)
    if a.quick:
        a.cases, a.steps = ["quick"], 2
    for name in a.cases:
        eager, comp = run_case(name, False, a), run_case(name, True, a)
        ratio_wall, ratio_cpu = comp["wall_s"] / eager["wall_s"], comp["cpu_s"] / eager["cpu_s"]
        target = TARGETS.get(name)
        goal = f" (target <= {target})" if target else ""
        print(
            f"{name}: step eager {eager['wall_s'] * 1e3:.0f} ms wall / "
            f"{eager['cpu_s'] * 1e3:.0f} ms CPU, compiled {comp['wall_s'] * 1e3:.0f} ms wall / "
            f"{comp['cpu_s'] * 1e3:.0f} ms CPU: compiled/eager {ratio_wall:.3f} wall, "
            f"{ratio_cpu:.3f} CPU{goal}"
        )
        print(
            f"{name}: first step eager {eager['first_step_s']:.1f} s, compiled "
            f"{comp['first_step_s']:.1f} s (tracing + compiling; cache {a.cache_dir})"
        )
        for line in comp["report"].lines():
            print(f"{name}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
