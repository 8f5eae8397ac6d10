"""model.compile against eager: step time of the real trainer, compile time and graph breaks,
then FP8 against bf16 GEMMs (tools/bench_fp8.py's figures, issue #41 item 3).

    python tools/bench_compile.py                  # one rank (4 layers, h1024) and quickstart
    python tools/bench_compile.py --cases one_rank --steps 8 --profile
    python tools/bench_compile.py --quick          # a tiny model on one rank (the unit test's)

Each case runs on fresh spawned ranks over gloo with a FileStore, --threads torch threads per
rank, and each rank builds two trainers, eager and model.compile=true (dynamo touches only the
compiled one's regions). Each trainer's first step (where the regions compile) is timed alone;
then --steps rounds run one step of each, alternating which goes first, so that a shared
machine's changing load hits both alike (separate runs one after the other differed by 10%).
The step time is the median over the rounds, in wall time and in process CPU time summed over
the ranks (other jobs on the machine do not count in CPU time: use it where the wall clock is
disturbed); the per-round ratios show the spread. --profile adds tools/compile_profile.py's
table of where the step's time goes and its GEMM floor.
Cases: `one_rank`, issue #41's 4-layer h1024 Llama (16 heads, seq 256, micro batch 2) on one
rank; `quickstart`, configs/quickstart.yaml's model and layout (tp2+SP, pp2 1F1B, dp2 ZeRO-1 on
8 ranks) on mock data of its vocabulary size. Inductor's cache goes to --cache-dir (a second
run of this tool compiles from it: its first step shows the saving). The FP8 figures run at a
small shape by default (--fp8-shape; bf16 GEMMs are slow on a CPU), --no-fp8 skips them.
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

MODES = ("eager", "compiled")
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


def _trainer(argv: list[str], world: int):
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(argv, world_size=world)
    return Trainer(cfg, ParallelMesh(rank_layout(cfg.parallel, world)), dataset, vocab)


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _rank(rank: int, world: int, store: str, argvs: dict, opts: dict, queue):
    """One rank: an eager and a compiled trainer side by side; each one's first step, then
    `steps` rounds of one step of each (alternating which goes first, so load drift on a
    shared machine hits both alike), each timed (wall, CPU); optionally profiled steps."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    trainers = {k: _trainer(argvs[k], world) for k in MODES}
    first = {k: _timed(trainers[k].train_step) for k in MODES}
    times = {k: [] for k in MODES}
    for i in range(opts["steps"]):
        for k in MODES if i % 2 == 0 else MODES[::-1]:
            times[k].append(_timed(trainers[k].train_step))
    from megatron_lite.models.compile import compile_report

    out = dict(first=first, times=times, report=compile_report())
    if opts["profile"]:
        from tools import compile_profile

        out["profile"] = {
            k: compile_profile.profile_steps(trainers[k].train_step, 3) for k in MODES
        }
        out["floor"] = compile_profile.gemm_floor(trainers["eager"].train_step)
    queue.put((rank, out))
    dist.destroy_process_group()


def _collect(queue, procs, timeout: float) -> list[dict]:
    """Each rank's result, in rank order; a rank that exits without one (a crash) stops the
    wait at once instead of after `timeout`, naming it."""
    import queue as queues

    got, deadline = {}, time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            rank, out = queue.get(timeout=5)
            got[rank] = out
        except queues.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]})"
                raise RuntimeError(
                    f"bench_compile: {why if dead else f'timeout {timeout} s'}"
                ) from None
    for p in procs:
        p.join(timeout=60)
    return [got[r] for r in range(len(procs))]


def run_case(name: str, a: argparse.Namespace) -> dict:
    """One case on fresh spawned ranks, each running the eager and the compiled trainer ->
    figures per mode: first_step_s, wall_s, cpu_s (medians; CPU summed over ranks)."""
    world, config, overrides = CASES[name]
    steps = a.steps
    with tempfile.TemporaryDirectory() as tmp:
        base = ([] if config is None else ["--config", config]) + [
            *overrides, *MOCK, f"train.steps={steps + 10}",
        ]  # fmt: skip
        argvs = {k: [*base, f"train.out_dir={tmp}/{k}", f"model.compile={k == 'compiled'}".lower()]
                 for k in MODES}  # fmt: skip
        if a.mode:
            argvs["compiled"].append(f"model.compile_mode={a.mode}")
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        # inherited by the spawned ranks; one compile thread each (a worker pool per rank
        # oversubscribes a small machine)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        opts = dict(steps=steps, threads=a.threads, profile=a.profile)
        args = (world, f"{tmp}/store", argvs, opts, queue)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        results = _collect(queue, procs, a.timeout)
    figures = {}
    for k in MODES:
        walls = [max(r["times"][k][i][0] for r in results) for i in range(steps)]
        cpus = [sum(r["times"][k][i][1] for r in results) for i in range(steps)]
        figures[k] = {
            "first_step_s": max(r["first"][k][0] for r in results),
            "wall_s": statistics.median(walls),
            "cpu_s": statistics.median(cpus),
            "cpus": cpus,
        }
    figures["report"] = results[0]["report"]
    if a.profile:  # summed over ranks
        figures["profile"] = {
            k: {c: sum(r["profile"][k][c] for r in results) for c in results[0]["profile"][k]}
            for k in MODES
        }
        figures["floor"] = {
            c: sum(r["floor"].get(c, 0.0) for r in results) for c in ("GEMM", "SDPA")
        }
    return figures


def _print_case(name: str, f: dict, a: argparse.Namespace) -> None:
    eager, comp = f["eager"], f["compiled"]
    ratio_wall, ratio_cpu = comp["wall_s"] / eager["wall_s"], comp["cpu_s"] / eager["cpu_s"]
    pairs = " ".join(f"{c / e:.3f}" for e, c in zip(eager["cpus"], comp["cpus"], strict=True))
    target = TARGETS.get(name)
    goal = f" (target <= {target})" if target else ""
    print(
        f"{name}: step eager {eager['wall_s'] * 1e3:.0f} ms wall / "
        f"{eager['cpu_s'] * 1e3:.0f} ms CPU, compiled {comp['wall_s'] * 1e3:.0f} ms wall / "
        f"{comp['cpu_s'] * 1e3:.0f} ms CPU: compiled/eager {ratio_wall:.3f} wall, "
        f"{ratio_cpu:.3f} CPU{goal}; per round (CPU): {pairs}"
    )
    print(
        f"{name}: first step eager {eager['first_step_s']:.1f} s, compiled "
        f"{comp['first_step_s']:.1f} s (tracing + compiling; cache {a.cache_dir})"
    )
    for line in f["report"].lines():
        print(f"{name}: {line}")
    if "profile" in f:
        from tools import compile_profile

        prof, floor = f["profile"], f["floor"]
        print(f"{name}: profile, ms per step (median of 3 profiled steps, summed over ranks):")
        for line in compile_profile.table(prof["eager"], prof["compiled"]):
            print(f"{name}:   {line}")
        fixed = floor["GEMM"] + floor["SDPA"] + prof["eager"]["optimizer"]
        best = fixed + prof["compiled"]["inductor kernels"]
        print(
            f"{name}: floor: the GEMMs replayed alone {floor['GEMM'] * 1e3:.0f} ms + SDPA "
            f"{floor['SDPA'] * 1e3:.0f} ms + the optimizer "
            f"{prof['eager']['optimizer'] * 1e3:.0f} ms (all outside inductor's reach) = "
            f"{fixed / prof['eager']['step']:.3f} of the profiled eager step (with the "
            f"compiled run's inductor kernels: {best / prof['eager']['step']:.3f})"
        )


def _print_fp8(shape: tuple[int, int, int]) -> None:
    """tools/bench_fp8.py's figures (issue #41 item 3) at `shape` (tokens, in, out)."""
    from tools.bench_fp8 import fp8_gemm_figures

    rows = fp8_gemm_figures(*shape, reps=3)
    base = rows[0]["ms"]
    print(f"fp8: GEMMs of x [{shape[0]}, {shape[1]}] · W [{shape[2]}, {shape[1]}]ᵀ, one thread")
    for r in rows:
        print(
            f"fp8: {r['path']:<10} rel. error fwd {r['forward']:.2e} dgrad {r['dgrad']:.2e} "
            f"wgrad {r['wgrad']:.2e}; 3 GEMMs {r['ms']:.1f} ms ({r['ms'] / base:.2f}x bf16)"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["one_rank", "quickstart"], choices=CASES)
    p.add_argument("--steps", type=int, default=6, help="timed rounds after the first step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--mode", default=None, help="model.compile_mode")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--cache-dir",
        default=os.path.join(tempfile.gettempdir(), "megatron_lite_inductor_bench"),
        help="TORCHINDUCTOR_CACHE_DIR",
    )
    p.add_argument("--profile", action="store_true", help="category table and GEMM floor")
    p.add_argument(
        "--fp8-shape", nargs=3, type=int, default=(256, 256, 512), metavar=("TOKENS", "IN", "OUT"),
        help="FP8 vs bf16 GEMMs (tools/bench_fp8.py) at this shape; bf16 is slow on a CPU",
    )  # fmt: skip
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8 vs bf16 GEMM figures")
    p.add_argument("--quick", action="store_true", help="the tiny case, 2 timed rounds")
    a = p.parse_args(argv)
    if a.quick:
        a.cases, a.steps = ["quick"], 2
    for name in a.cases:
        _print_case(name, run_case(name, a), a)
    if not a.no_fp8:
        _print_fp8(tuple(a.fp8_shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
