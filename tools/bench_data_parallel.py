"""Data-parallel benchmark: step time and per-rank model-state memory of our ZeRO stages (with
and without overlap) beside torch FSDP2 alone and DeepSpeed ZeRO 1/2/3, same model and batch.

    nice python tools/bench_data_parallel.py [--world 4] [--steps 4] [--rounds 3] \
        [--stages 0,1,2,3] [--no-peers] [--quick] [--out-dir runs/bench_data_parallel]

All configurations run in one set of `--world` ranks (gloo on CPU, nccl on CUDA), built once
and then timed in `--rounds` rounds of blocks, each block one warm-up step and `--steps` timed
steps of one configuration back to back (the order reversed every other round, so drift on a
shared machine spreads over all of them). A step's time is the slowest rank's wall time of the
whole optimizer step (ours: `Trainer.train_step()`); the table gives the median over all timed
steps and the quartiles. Ours also records, per step, the blocking gradient sync
(`finish_grad_sync`) and the exposed parameter all-gather (`dp.step` minus the AdamW step), the
smallest over ranks (the last rank to arrive waits only for the communication itself).

Model-state bytes are read once per configuration, at the end of the gradient synchronization
of a step after the first (optimizer states exist, the gradients are final and reduced) by one
walk of the tensors actually allocated, unique storages, max over ranks (see
`model_state_bytes`), and set against the ZeRO formula (fp32: weights 4, grads 4, AdamW 8 bytes
per parameter, each divided by N from stage 3, 2 and 1 on). Writes table.txt, results.csv,
results.json and plot.png under --out-dir.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools.bench_data_parallel_peers import PlainLlama, Shape  # noqa: E402

QUICK = Shape(vocab=512, layers=2, hidden=64, heads=4, groups=2, ffn=128, seq=32)
LR, WEIGHT_DECAY = 1e-4, 0.1
KINDS = ("weights", "grads", "master", "optimizer", "other")
# objects whose attributes the memory walk follows (gradient buffers, ZeRO partitions)
WALKED = ("megatron_lite", "deepspeed", "torch.distributed.fsdp", "torch.optim")
# a reachable tensor's kind from its attribute path, first match (DeepSpeed: `ipg` buckets are
# gradient buckets; ZeRO-3 drops its fp32 partitions from the torch optimizer between steps)
PATH_KINDS = (("grad", "grads"), ("ipg", "grads"), ("fp32", "master"), ("master", "master"))


# ------------------------------------------------------------------ model-state memory
def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> this rank's shard


def torch_optimizer(opt) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper (ours: `.inner`, DeepSpeed: `.optimizer`)."""
    while not isinstance(opt, torch.optim.Optimizer):
        opt = getattr(opt, "inner", None) or opt.optimizer
    return opt


def reachable_tensors(roots):
    """(attribute path, tensor) for every tensor reachable from `roots` through containers and
    the attributes of our, DeepSpeed's, FSDP's and torch.optim's objects (not through modules)."""
    stack, seen = [(r, type(r).__name__) for r in roots], set()
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, torch.nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield path, obj
        elif isinstance(obj, dict):
            stack += [(v, f"{path}[{k!r}]"[:200]) for k, v in obj.items()]
            stack += [(k, path) for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, list | tuple | set):
            stack += [(v, f"{path}[]") for v in obj]
        elif type(obj).__module__.startswith(WALKED) and hasattr(obj, "__dict__"):
            stack += [(v, f"{path}.{k}") for k, v in vars(obj).items()]


def model_state_bytes(params, optimizer, roots=()) -> dict:
    """Bytes of one rank's model states, each storage counted once, whole, in this order:
    weights (the parameters' local data), master weights (the torch optimizer's parameters that
    are not weights), optimizer states, grads (`.grad`/`.main_grad` of both), then every other
    tensor reachable from the optimizer and `roots`, of the kind its attribute path names
    (`PATH_KINDS`: gradient buffers, shards and partitions; fp32 partitions), else other
    (the largest listed in `other_paths`)."""
    inner = torch_optimizer(optimizer)
    masters = [p for g in inner.param_groups for p in g["params"]]
    out, seen, other_paths = dict.fromkeys(KINDS, 0), set(), {}

    def add(kind: str, tensors, path: str = "") -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = _local(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:  # freed (ZeRO-2/3) or seen
                continue
            seen.add(storage.data_ptr())
            out[kind] += storage.nbytes()
            if kind == "other":
                other_paths[path] = other_paths.get(path, 0) + storage.nbytes()

    add("weights", params)
    add("master", masters)
    add("optimizer", (v for state in inner.state.values() for v in state.values()))
    grads = [getattr(p, name, None) for p in (*params, *masters) for name in ("grad", "main_grad")]
    add("grads", (_local(g) for g in grads if g is not None))
    for path, t in reachable_tensors([optimizer, *roots]):
        kind = next((k for word, k in PATH_KINDS if word in path.lower()), "other")
        add(kind, [t], path)
    out["other_paths"] = dict(sorted(other_paths.items(), key=lambda kv: -kv[1])[:8])
    return out


# ------------------------------------------------------------------ the configurations
def ours_overrides(shape: Shape, world: int, stage: int, overlap: bool, bucket: int) -> list:
    s, flag = shape, str(overlap).lower()
    return [
        f"model.vocab_size={s.vocab}", f"model.num_layers={s.layers}",
        f"model.hidden_size={s.hidden}", f"model.num_attention_heads={s.heads}",
        f"model.num_query_groups={s.groups}", f"model.ffn_hidden_size={s.ffn}",
        f"model.seq_length={s.seq}", "model.make_vocab_size_divisible_by=8",
        "model.attention_backend=sdpa", "data.mock=true",
        f"train.micro_batch_size={s.micro_batch}",
        f"train.global_batch_size={s.micro_batch * world}", "train.steps=1000000",
        f"train.lr={LR}", "train.warmup_steps=1", f"train.weight_decay={WEIGHT_DECAY}",
        "log.progress=false", f"parallel.zero_stage={stage}", f"parallel.ddp_bucket_size={bucket}",
        f"parallel.overlap_grad_reduce={flag}", f"parallel.overlap_param_gather={flag}",
    ]  # fmt: skip


def plan(stages: list[int], world: int, shape: Shape, bucket: int, peers: bool) -> list[dict]:
    """The configurations in run order; ours that the config validation rejects carry a note."""
    from megatron_lite.config import ConfigError, load_config
    from megatron_lite.validation import validate

    cases = []
    for stage in stages:
        for overlap in (True, False):
            overrides = ours_overrides(shape, world, stage, overlap, bucket)
            note = ""
            try:
                validate(load_config(None, overrides), world)
            except ConfigError as e:
                note = "skipped: config validation rejects it: " + str(e).splitlines()[0]
            name = f"ours z{stage} overlap {'on' if overlap else 'off'}"
            cases.append(dict(name=name, family="ours", stage=stage, overlap=overlap, note=note))
    if peers:
        cases.append(dict(name="torch FSDP2", family="fsdp2", stage=3, overlap=True, note=""))
        for stage in (1, 2, 3):
            name = f"DeepSpeed ZeRO-{stage}"
            cases.append(dict(name=name, family="deepspeed", stage=stage, overlap=True, note=""))
    return cases


class OursRunner:
    """The real Trainer from a config; `train_step()` on the same global batch every step, with
    the blocking grad sync, the exposed all-gather and the memory probe hooked in."""

    def __init__(self, overrides: list[str], world: int, out_dir: str):
        from megatron_lite.parallel.mesh import ParallelMesh
        from megatron_lite.resolve import rank_layout
        from megatron_lite.train import prepare
        from megatron_lite.training.trainer import Trainer

        cfg, dataset, vocab = prepare([f"train.out_dir={out_dir}", *overrides], world_size=world)
        p = cfg.parallel
        mesh = ParallelMesh(rank_layout(p, world))
        self.trainer = Trainer(cfg, mesh, dataset, vocab)
        self.memory, self.phases, self._probe = None, {}, None
        self._instrument(self.trainer.dp, self.trainer.optimizer)

    def _instrument(self, dp, opt) -> None:
        sync, dp_step, opt_step = dp.finish_grad_sync, dp.step, opt.step

        def timed_sync() -> None:
            t0 = time.perf_counter()
            sync()
            self.phases["sync"] = time.perf_counter() - t0

        def probed_opt_step() -> None:
            if self._probe is not None:
                self.memory, self._probe = self._probe(*self.memory_args()), None
            t0 = time.perf_counter()
            opt_step()
            self.phases["adamw"] = time.perf_counter() - t0

        def timed_dp_step() -> None:  # AdamW, then the all-gather (waited for unless overlapped)
            t0 = time.perf_counter()
            dp_step()
            self.phases["gather"] = time.perf_counter() - t0 - self.phases.get("adamw", 0.0)

        dp.finish_grad_sync, dp.step, opt.step = timed_sync, timed_dp_step, probed_opt_step

    def memory_args(self):
        """model_state_bytes' arguments: parameters, optimizer, roots (DataParallel, FSDP)."""
        t = self.trainer
        fsdp = [m._get_fsdp_state() for c in t.chunks for m in c.modules() if _fsdp(m)]
        return t.params, t.optimizer, [t.dp, *fsdp]

    def step(self, probe) -> None:
        self._probe, self.phases = probe, {}
        self.trainer.consumed_samples = 0  # the same global batch every step
        self.trainer.train_step()
        if self._probe is not None:  # no hook point (another engine): after the step
            self.memory, self._probe = self._probe(*self.memory_args()), None


def _fsdp(module: torch.nn.Module) -> bool:
    return hasattr(module, "_get_fsdp_state")


def fixed_batch(shape: Shape, world: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's microbatch (tokens, labels) [b, s] of global batch 0 of our mock data."""
    from megatron_lite.data.sampler import microbatches_at, split_sample
    from megatron_lite.train import prepare

    cfg, dataset, _ = prepare(ours_overrides(shape, world, 0, True, 1), world_size=world)
    t = cfg.train
    rank = dist.get_rank()
    (mb,) = microbatches_at(dataset, 0, t.global_batch_size, t.micro_batch_size, rank, world)
    tokens, labels = split_sample(mb)
    return tokens.to(device), labels.to(device)


# ------------------------------------------------------------------ one rank
def build_runner(case: dict, a: argparse.Namespace, shape: Shape, batch, device, out_dir: str):
    from tools import bench_data_parallel_peers as peers

    if case["family"] == "ours":
        overrides = ours_overrides(shape, a.world, case["stage"], case["overlap"], a.bucket_size)
        return OursRunner(overrides, a.world, os.path.join(out_dir, case["name"].replace(" ", "_")))
    if case["family"] == "fsdp2":
        return peers.FSDP2Runner(shape, batch, device, LR, WEIGHT_DECAY)
    return peers.DeepSpeedRunner(
        case["stage"], shape, batch, device, LR, WEIGHT_DECAY, a.bucket_size
    )


def unavailable(case: dict) -> str:
    """Why an optional peer cannot run here ('' when it can): DeepSpeed not importable."""
    from tools import bench_data_parallel_peers as peers

    if case["family"] != "deepspeed":
        return ""
    try:
        peers.import_deepspeed()
    except Exception as e:  # not installed, or broken on this machine: either way, say so
        return (
            f"skipped: import deepspeed failed ({type(e).__name__}: {e}); pip install -e .[bench]"
        )
    return ""


def bench_rank(rank: int, a: argparse.Namespace, shape: Shape, cases, store: str, queue) -> None:
    """Build every runnable configuration, time them in rounds of blocks, send rank 0's
    summary (per-step slowest rank, per-step smallest grad sync, max memory) to `queue`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(a.world), MEGATRON_LITE_QUIET="1")
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=a.world)
    batch = fixed_batch(shape, a.world, device)
    runners, notes = {}, {}
    for case in (c for c in cases if not c["note"]):
        if note := unavailable(case):
            notes[case["name"]] = note
            if rank == 0:
                print(f"{case['name']}: {note}", flush=True)
            continue
        runner = build_runner(case, a, shape, batch, device, os.path.dirname(store))
        torch.set_num_threads(1)  # whatever an engine set
        runner.step(None)  # first step: optimizer states allocated
        runner.step(model_state_bytes)
        runners[case["name"]] = runner
    ours = [r for r in runners.values() if isinstance(r, OursRunner)]
    info = {"num_parameters_ours": ours[0].trainer.num_parameters() if ours else None}
    timed = {name: {"step": [], "sync": [], "gather": []} for name in runners}
    profiler = None
    for r in range(a.rounds):
        for name in list(runners)[:: 1 if r % 2 == 0 else -1]:
            runner = runners[name]
            dist.barrier()
            runner.step(None)  # warm-up after switching configurations
            if rank == 0 and name == a.profile:
                import cProfile

                profiler = profiler or cProfile.Profile()
                profiler.enable()
            for _ in range(a.steps):
                t0 = time.perf_counter()
                runner.step(None)
                timed[name]["step"].append(time.perf_counter() - t0)
                phases = getattr(runner, "phases", {})
                for k in ("sync", "gather"):
                    timed[name][k].append(phases.get(k, float("nan")))
            if profiler is not None and name == a.profile:
                profiler.disable()
    everyone = [None] * a.world
    local = {n: (timed[n], runners[n].memory) for n in runners}
    dist.all_gather_object(everyone, local)
    if rank == 0:
        if profiler is not None:
            _write_profile(profiler, os.path.join(a.out_dir, "profile.txt"))
        queue.put((_combine(everyone), notes, info))
    dist.barrier()
    dist.destroy_process_group()


def _combine(everyone: list[dict]) -> dict:
    """Per configuration: step times (slowest rank per step), grad sync and exposed gather
    (smallest over ranks per step), model-state bytes (max over ranks per kind)."""
    out = {}
    for name in everyone[0]:
        t = [e[name][0] for e in everyone]
        mem = [e[name][1] for e in everyone]
        out[name] = {
            "step_s": [max(x) for x in zip(*(r["step"] for r in t), strict=True)],
            "sync_s": [min(x) for x in zip(*(r["sync"] for r in t), strict=True)],
            "gather_s": [min(x) for x in zip(*(r["gather"] for r in t), strict=True)],
            "memory": {k: max(m[k] for m in mem) for k in KINDS},
            "other_paths": mem[0]["other_paths"],
        }
    return out


def _write_profile(profiler, path: str) -> None:
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    with open(path, "w") as f:
        f.write(text.getvalue())


# ------------------------------------------------------------------ the command line
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=None, help="ranks (default 4; --quick: 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per block (default 4)")
    p.add_argument("--rounds", type=int, default=None, help="blocks per configuration (3)")
    p.add_argument("--stages", default="0,1,2,3", help="our ZeRO stages, comma-separated")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="parameters per gradient bucket, ours and DeepSpeed's (default 500000: "
                   "one bucket per transformer layer, FSDP2's granularity)")  # fmt: skip
    p.add_argument("--no-peers", action="store_true", help="ours only (no FSDP2, no DeepSpeed)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 ranks, 1 round of 2")
    p.add_argument("--profile", default=None, help="cProfile rank 0 in this configuration's "
                   "timed steps (e.g. 'ours z1 overlap on'), written to profile.txt")  # fmt: skip
    p.add_argument("--out-dir", default="runs/bench_data_parallel")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    a = p.parse_args(argv)
    quick = dict(world=2, steps=2, rounds=1, bucket_size=2000)
    full = dict(world=4, steps=4, rounds=3, bucket_size=500_000)
    for key, value in (quick if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


def run(a: argparse.Namespace) -> dict:
    """Plan, run the ranks, write the outputs; returns the results (see results.json)."""
    import multiprocessing as mp

    from tools import bench_data_parallel_report as report

    shape = QUICK if a.quick else Shape()
    stages = [int(s) for s in a.stages.split(",") if s.strip()]
    cases = plan(stages, a.world, shape, a.bucket_size, peers=not a.no_peers)
    os.makedirs(a.out_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    context = {"load_before": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__}
    # the formula's parameter count (each element once: the tied output weight is the embedding)
    context["num_parameters"] = sum(p.numel() for p in PlainLlama(shape).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=bench_rank, args=(r, a, shape, cases, store, queue), daemon=True)
            for r in range(a.world)
        ]
        for proc in procs:
            proc.start()
        try:
            measured, notes, info = _wait(procs, queue, a.timeout)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    for case in cases:
        case["note"] = case["note"] or notes.get(case["name"], "")
    context.update(info, load_after=os.getloadavg())
    return report.write(a, shape, cases, measured, context)


def _wait(procs, queue, timeout: float):
    """Rank 0's results; fails fast when a rank dies (its traceback is on stderr) or hangs."""
    import queue as queue_module

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"ranks (rank, exit code) {dead} failed; see their errors above")
    raise TimeoutError(f"the ranks did not finish within --timeout {timeout:.0f}s")


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
