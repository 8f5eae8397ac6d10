"""`--dry-run`: the real training step of chosen ranks at the config's full sizes, on a CPU,
with no real memory and no other processes, and its memory beside the planner's.

For each chosen rank, one after another in this process:
- a fake process group of the full world size (torch's "fake" backend: every collective
  returns at once) with this rank's number, and the real `ParallelMesh` over it;
- tensors under `FakeTensorMode`: shapes, dtypes and devices, no data, so a 70B stage costs
  nothing but the Python of its ops;
- the real `Trainer`: the same model build, pipeline schedule, ZeRO stage or FSDP2, recompute
  and optimizer as a real run. Host reads go through `parallel.host.read`, which answers a
  fake tensor with the step's nominal value (a finite loss, balanced MoE routing);
- a `MemoryTracker` (training/memory_tracker.py) around all of it: every allocation and free
  in order. Step 1 creates the optimizer states; the peak of step 2 (the steady state) is the
  figure, by category and with the phase it happened in; the build's peak is the
  initialization memory.

The data are mock token ids (the step's shapes do not depend on them). By default the step
runs the fewest microbatches that reach the schedule's steady state (`steady_microbatches`,
2·pp: the same peak as M), so a dry run of a 256-microbatch step takes
seconds; `microbatches=None` runs all M. The fused kernels
(kernels="fused", the default) run as on a GPU but without their launches: their autograd
functions allocate and save what they do on a GPU (kernels/dispatch.py `launch` skips fake
tensors); kernels="torch" runs the plain-torch references a CPU run uses. The prediction is the
planner's for the same kernels.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from megatron_lite.config import Config
from megatron_lite.plan.errors import flag_error
from megatron_lite.plan.memory import RankMemory, rank_memory
from megatron_lite.resolve import eod_token_id, num_microbatches, rank_layout

KERNELS_ENV = "MEGATRON_LITE_KERNELS"  # kernels/dispatch.py's switch
# The most microbatches per step a dry run runs: each runs the stage's real ops in Python
# (~0.1-1 s for a full-size stage), and the peak is reached by 2·pp (steady_microbatches), so
# more only adds time. 1024 is above the M of published recipes (Llama 3 405B, DeepSeek-V3:
# tens to hundreds) and still finishes; a count like 10^7 would run for weeks.
MAX_DRY_RUN_MICROBATCHES = 1024

# the dry run's categories (training/memory_tracker.py) against the planner's terms
PLANNER_TERMS = {
    "weights": ("weights",),
    "grads": ("grads",),
    "master": ("master",),
    "optimizer": ("optimizer",),
    "buffers": ("buffers",),
    "activations": ("activations", "embedding", "logits_loss"),
    "gathered+temporaries": ("working",),
}


@dataclass
class RankResult:
    """One rank's dry run: its coordinates, the steady-state peak by category, the phase of
    the peak, the build's peak, the step's collectives and the planner's prediction."""

    rank: int
    coords: dict[str, int]
    microbatches: int
    peak: int
    by_category: dict[str, int]
    phase: str
    init_peak: int
    comm: dict[str, float]
    wall_s: float
    predicted: RankMemory | None = None
    peaks_by_phase: dict[str, int] = field(default_factory=dict)
    category_peaks: dict[str, int] = field(default_factory=dict)  # each one's own maximum
    save_extra: int = 0  # bytes a checkpoint save's state adds (see _save_state_extra)
    device: str = "cpu"  # the rank's device: cpu, or cuda:<local rank> (--device cuda)
    host_syncs: dict[str, int] = field(default_factory=dict)  # cuda: "phase|kind|line": n
    host_peak: int = 0  # offloaded activations' host copies at most, in the steady step
    predicted_host: float = 0.0  # the planner's (plan/activation_offload.py)

    def grouped(self) -> dict[str, int]:
        """The categories summed the way PLANNER_TERMS compares them."""
        c = self.by_category
        return {
            "weights": c["weights"],
            "grads": c["grads"],
            "master": c["master"],
            "optimizer": c["optimizer"],
            "buffers": c["buffers"],
            "activations": c["activations"],
            "gathered+temporaries": c["gathered"] + c["temporaries"],
        }


def steady_microbatches(cfg: Config) -> int:
    """The fewest microbatches whose peak equals the full step's: 2·pp (pp = 1: 2, so gradient
    accumulation runs), never more than the config's M. 1F1B holds its most activations from
    pp microbatches on (the schedule record's `in_flight`), interleaved from its warmup + 1 <
    2·pp·vpp (and needs a multiple of pp), but ZeRO-2's buckets in flight at the peak need a
    microbatch past the warmup too (measured: a tp8 pp2 ZeRO-2 stage's working buffers differ
    at m = pp)."""
    p = cfg.parallel
    return min(num_microbatches(cfg.train, p.dp), 2 * p.pp)


def dry_run_config(cfg: Config, out_dir: str, microbatches: int | None) -> Config:
    """`cfg` (validated) made to run two steps of `microbatches` per rank on mock data (with the
    real data's EOD id under document masking), writing nothing but its run directory's lock
    into `out_dir`."""
    c = copy.deepcopy(cfg)
    t = c.train
    if microbatches is not None:
        t.global_batch_size = microbatches * t.micro_batch_size * c.parallel.dp
    # 3 steps configured (2 run), so neither is the run's last: the trainer's saved-tensor
    # meter, which a progress line reads, runs on the first step only
    t.steps, t.save_interval, t.eval_interval = 3, 0, 0
    c.log.interval = 1000
    t.out_dir, t.ckpt_dir, t.resume, t.init_from = out_dir, None, "none", None
    t.profile_steps, t.profile_pipeline = [], False
    c.log.progress = False
    # document masking's EOD id resolved from the real data's tokenizer first: mock data has
    # none (resolve.eod_token_id is None there), and a None id made the masks from a bool
    c.data.eod_token_id = eod_token_id(cfg.data)
    c.data.mock = True  # mock token ids need the vocabulary the planner resolved
    return c


def default_ranks(cfg: Config, world: int) -> list[int]:
    """One rank per pipeline stage (the one with every other coordinate 0): ranks of one stage
    hold the same shapes (TP, CP, DP and EP shards are equal)."""
    p = cfg.parallel
    layout = rank_layout(p, world)
    firsts = {}
    for rank in range(world):
        c = layout.coords(rank)
        if all(v == 0 for k, v in c.items() if k != "pp"):
            firsts.setdefault(c["pp"], rank)
    return [firsts[s] for s in sorted(firsts)]


def tracked_steps(cfg: Config, mesh, dataset, vocab: int, audit=None) -> dict:
    """Build the Trainer and run its two steps under a MemoryTracker (see the module
    docstring): what a dry run measures on fake tensors and a real run on real ones, by the
    same code. Returns the figures of RankResult. audit: a CUDA dry run's
    (plan/cuda_dry_run.py), told the tracker and each step."""
    from megatron_lite.parallel.comm_stats import STATS
    from megatron_lite.training.memory_tracker import MemoryTracker
    from megatron_lite.training.trainer import Trainer

    with MemoryTracker() as tracker:
        trainer = Trainer(cfg, mesh, dataset, vocab)
        init_peak = tracker.peak.total
        tracker.label([b for c in trainer.chunks for b in c.buffers()], "buffers")
        tracker.attach_layers(trainer.chunks)
        step = audit.in_step if audit is not None else lambda _: contextlib.nullcontext()
        if audit is not None:
            audit.attach(tracker)
        trainer.memory_tracker = tracker  # the trainer names its phases in it
        t = cfg.train  # the first step only creates the lazy state: its fewest microbatches
        full, t.global_batch_size = (
            t.global_batch_size,
            _fewest_microbatches(cfg) * (t.micro_batch_size * cfg.parallel.dp),
        )
        try:
            with step(0):
                trainer.train_step()  # creates the optimizer states (and FSDP2's lazy state)
        finally:
            t.global_batch_size = full
        tracker.label_model_states(trainer.dp)
        tracker.attach_fsdp(m for c in trainer.chunks for m in c.modules())
        tracker.reset_peak()
        with step(1):
            trainer.train_step()  # the steady state
        peak, phases = tracker.peak, dict(tracker.peaks_by_phase)
        host_peak = tracker.host_peak
        category_peaks = dict(tracker.category_peaks)
        save_extra = _save_state_extra(trainer, mesh, tracker)  # resets the peaks
        return {
            "peak": peak.total,
            "by_category": dict(peak.by_category),
            "phase": peak.phase,
            "init_peak": init_peak,
            "comm": dict(STATS.summary()),
            "peaks_by_phase": phases,
            "category_peaks": category_peaks,
            "save_extra": save_extra,
            "host_peak": host_peak,
        }


def _fewest_microbatches(cfg: Config) -> int:
    """The fewest microbatches the pipeline schedule accepts (pipeline/schedules.py)."""
    return _next_valid_count(cfg, 1)


def _next_valid_count(cfg: Config, start: int) -> int:
    """The smallest count >= `start` the pipeline schedule runs (microbatches_problem, the rule
    validation checks train.global_batch_size with); one is at most 2·pp·vpp + 1 away."""
    from megatron_lite.pipeline.schedules import microbatches_problem

    p = cfg.parallel
    return next(
        m
        for m in range(start, start + 2 * p.pp * p.vpp + 2)
        if not microbatches_problem(p.pp, m, p.vpp, p.pipeline_schedule)
    )


def _save_state_extra(trainer, mesh, tracker) -> int:
    """The bytes a checkpoint save adds to this rank while it builds what it writes (the real
    `checkpoint.holdings.save_state`: views of the chunks this rank holds; DCP's file writer,
    which needs data, is not run)."""
    import torch.distributed as dist

    from megatron_lite.checkpoint.holdings import save_state

    tracker.reset_peak()
    before = tracker.total
    with tracker.phase("save", working=True):
        state = save_state(trainer.chunks, trainer.dp.optimizer, mesh, trainer.tracker,
                           dist.get_rank())  # fmt: skip
        extra = tracker.peak.total - before
        del state
    return extra


def _result(cfg: Config, world: int, rank: int, kernels: str, figures: dict, t0: float):
    p = cfg.parallel
    coords = rank_layout(p, world).coords(rank)
    return RankResult(
        rank=rank,
        coords=coords,
        microbatches=num_microbatches(cfg.train, p.dp),
        wall_s=time.perf_counter() - t0,
        predicted=rank_memory(cfg, world, coords["pp"], kernels),
        predicted_host=_predicted_host(cfg, coords["pp"], kernels),
        **figures,
    )


def _predicted_host(cfg: Config, pp_rank: int, kernels: str) -> float:
    """The planner's host bytes of model.activation_offload on this pipeline rank (0: off)."""
    if not cfg.model.activation_offload:
        return 0.0
    from megatron_lite.plan.activation_offload import stage_offload

    return stage_offload(cfg, pp_rank, 0.0, 1.0, kernels=kernels).host_peak_bytes


def run_rank(cfg: Config, world: int, rank: int, kernels: str = "fused",
             device: str = "cpu") -> RankResult:  # fmt: skip
    """The dry run of one rank (see the module docstring); `cfg` from dry_run_config;
    kernels: "fused" (the GPU's Triton kernels: their allocations, no launches) or "torch"
    (the plain-torch references a CPU run uses); device: "cpu", or "cuda": fake CUDA tensors
    with their placement checked and host syncs counted (plan/cuda_dry_run.py; a misplaced
    tensor raises device_check.DeviceMismatch)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_lite.data import build_dataset
    from megatron_lite.parallel.fake import FakeTensorMode
    from megatron_lite.parallel.mesh import ParallelMesh

    p = cfg.parallel
    t0 = time.perf_counter()
    dataset, vocab = build_dataset(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    forced = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = "triton" if kernels == "fused" else "torch"
    try:
        layout = rank_layout(p, world)
        mesh = ParallelMesh(layout, timeout_s=p.timeout_s)  # DeviceMesh needs real tensors
        if device == "cuda":
            from megatron_lite.plan.cuda_dry_run import cuda_step, steady_syncs

            with cuda_step(rank) as audit:
                figures = tracked_steps(cfg, mesh, dataset, vocab, audit)
            figures |= {"device": audit.device, "host_syncs": steady_syncs(audit)}
        else:
            with FakeTensorMode(allow_non_fake_inputs=True):
                figures = tracked_steps(cfg, mesh, dataset, vocab)
    finally:
        dist.destroy_process_group()
        if forced is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = forced
    return _result(cfg, world, rank, kernels, figures, t0)


def _real_rank(cfg: Config) -> tuple[int, dict, float]:
    """tracked_steps on this gloo rank of a real run (plan.measure.run_local's child)."""
    import torch.distributed as dist

    from megatron_lite.data import build_dataset
    from megatron_lite.parallel.mesh import ParallelMesh

    p, t0 = cfg.parallel, time.perf_counter()
    layout = rank_layout(p, dist.get_world_size())
    mesh = ParallelMesh(layout, timeout_s=p.timeout_s)
    dataset, vocab = build_dataset(cfg)
    figures = tracked_steps(cfg, mesh, dataset, vocab)
    return dist.get_rank(), figures, time.perf_counter() - t0


def real_run(cfg: Config, world: int, ranks: list[int] | None = None,
             microbatches: int | str = "steady") -> list[RankResult]:  # fmt: skip
    """The same two tracked steps on `world` real gloo ranks on this machine (CPU, plain-torch
    kernels), for checking a dry run against what really is allocated; results of `ranks`
    (default: default_ranks)."""
    from megatron_lite.plan.measure import run_local

    ranks = ranks or default_ranks(cfg, world)
    with tempfile.TemporaryDirectory() as tmp:
        run_cfg = dry_run_config(cfg, tmp, _count(cfg, microbatches))
        out = run_local(run_cfg, world, _real_rank, one_step=False)
    now = time.perf_counter()
    by_rank = {rank: (figures, now - wall) for rank, figures, wall in out}
    return [_result(run_cfg, world, r, "torch", *by_rank[r]) for r in ranks]


def _count(cfg: Config, microbatches: int | str) -> int | None:
    count = dry_run_microbatches(cfg, microbatches)
    return None if count == num_microbatches(cfg.train, cfg.parallel.dp) else count


def dry_run_microbatches(cfg: Config, microbatches: int | str) -> int:
    """The microbatches per step a dry run of `cfg` (validated) runs: "steady"
    (steady_microbatches), "all" (the config's M) or a count (an int, or its ASCII digits).
    ConfigError naming --microbatches when the count is not one, when the pipeline schedule
    cannot run it (pipeline/schedules.py microbatches_problem), when it is above the config's M
    (the dry run measures the config's step), or when it is above MAX_DRY_RUN_MICROBATCHES."""
    p = cfg.parallel
    m = num_microbatches(cfg.train, p.dp)
    if microbatches == "steady":
        count = steady_microbatches(cfg)
    elif microbatches == "all":
        count = m
    else:
        count = _count_of(microbatches)
        _microbatch_rule(cfg, count, m)
    if count > MAX_DRY_RUN_MICROBATCHES:
        flag_error(
            "--microbatches",
            microbatches,
            f"runs {count} microbatches per step, above the dry run's {MAX_DRY_RUN_MICROBATCHES} "
            f"(each one runs the stage's real ops in Python; the peak is reached by 2·pp = "
            f"{2 * p.pp})",
            f"--microbatches steady, or a count <= {MAX_DRY_RUN_MICROBATCHES}",
        )
    return count


def _count_of(microbatches: int | str) -> int:
    """A count: an int >= 1 or its ASCII digits ("²" and "١" are digits to str.isdigit, not
    here)."""
    if isinstance(microbatches, int) and not isinstance(microbatches, bool):
        count = microbatches
    elif isinstance(microbatches, str) and re.fullmatch(r"[0-9]{1,18}", microbatches):
        count = int(microbatches)
    else:
        count = 0
    if count < 1:
        rule = "must be steady, all or a count >= 1 (ASCII digits)"
        flag_error("--microbatches", microbatches, rule, "e.g. --microbatches 8")
    return count


def _microbatch_rule(cfg: Config, count: int, m: int) -> None:
    """A count the schedule runs (the rule train.global_batch_size is validated with) and at
    most the config's M."""
    from megatron_lite.pipeline.schedules import microbatches_problem

    p, t = cfg.parallel, cfg.train
    if count > m:
        flag_error(
            "--microbatches",
            count,
            f"is more than the config's {m} microbatches per step (train.global_batch_size="
            f"{t.global_batch_size} / micro_batch_size·dp = {t.micro_batch_size}·{p.dp}); the "
            "dry run measures the config's step",
            f"--microbatches all (= {m}), or raise train.global_batch_size",
        )
    problem = microbatches_problem(p.pp, count, p.vpp, p.pipeline_schedule)
    if problem is not None:
        near = _next_valid_count(cfg, count)
        fix = f"--microbatches {near}" if near <= m else "--microbatches all"
        flag_error("--microbatches", count, problem, f"{fix}, or steady")


def dry_run(cfg: Config, world: int, ranks: list[int] | None = None,
            microbatches: int | str = "steady",
            workers: int = os.cpu_count() or 1,
            kernels: str = "fused", device: str = "cpu") -> list[RankResult]:  # fmt: skip
    """Dry-run `ranks` (default: default_ranks) of `cfg` (validated for `world`), `workers`
    processes at a time; microbatches: "steady" (steady_microbatches), "all" (the config's
    M) or a count; device: "cpu" or "cuda" (run_rank)."""
    count = _count(cfg, microbatches)
    ranks = ranks or default_ranks(cfg, world)
    with tempfile.TemporaryDirectory() as tmp:
        run_cfg = dry_run_config(cfg, tmp, count)
        if len(ranks) == 1 or workers <= 1:
            return [run_rank(run_cfg, world, r, kernels, device) for r in ranks]
        # one process per rank at a time (each holds its own fake process group), as many
        # at once as there are cores
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(workers, len(ranks)), mp_context=ctx) as pool:
            n = len(ranks)
            args = [run_cfg] * n, [world] * n, ranks, [kernels] * n, [device] * n
            return list(pool.map(run_rank, *args))


def to_json(results: list[RankResult]) -> list[dict]:
    out = []
    for r in results:
        pred = r.predicted.terms if r.predicted else {}
        out.append({
            "rank": r.rank, "coords": r.coords, "microbatches": r.microbatches,
            "peak_bytes": r.peak, "peak_phase": r.phase, "init_peak_bytes": r.init_peak,
            "by_category": r.by_category, "compared": r.grouped(),
            "predicted": {k: sum(pred.get(t, 0.0) for t in v) for k, v in PLANNER_TERMS.items()},
            "predicted_peak_bytes": sum(pred.values()), "peaks_by_phase": r.peaks_by_phase,
            "comm": r.comm, "wall_s": r.wall_s, "save_extra_bytes": r.save_extra,
            "category_peaks": r.category_peaks, "device": r.device, "host_syncs": r.host_syncs,
            "host_peak_bytes": r.host_peak, "predicted_host_bytes": r.predicted_host,
        })  # fmt: skip
    return out
