"""Where a training step's time goes, eager against model.compile (tools/bench_compile.py
--profile): torch.profiler's self time by op category, and the step's GEMM floor.

Categories: `GEMM` (aten mm/addmm/bmm: the same calls eager and compiled, inductor's CPU backend
leaves them to aten), `SDPA` (aten's flash attention, also left to aten), `inductor kernels`
(the generated C++ kernels: the self time of the `## Call CompiledFxGraph` events, which run
them without profiler events of their own), `optimizer` (everything under `Optimizer.step` and
the gradient clip's norms), `collectives` (gloo / c10d), `other aten` (the rest: eager
elementwise ops, copies, the gradient buffer's adds). The profiler times in wall clock; on a
shared machine each step's categories are scaled to that step's process CPU time, except the
collectives: their self time is mostly waiting for the other ranks, so they stay in wall time
(and the CPU gloo spends is spread over the other categories).

`gemm_floor` replays the GEMMs (and SDPA calls) of one eager step alone, each the minimum CPU
time of 3 runs on tensors of the recorded shapes and strides: the part of the step no graph
compiler that keeps aten's GEMMs can remove.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch

GEMMS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")
CATEGORIES = ("GEMM", "SDPA", "inductor kernels", "optimizer", "collectives", "other aten")
_OPTIMIZER_OPS = ("linalg_vector_norm", "_foreach_norm")  # the gradient clip's


def category(ev) -> str:
    """The category (module docstring) of one profiler event's self time."""
    name = ev.name
    if name.removeprefix("aten::") in GEMMS:
        return "GEMM"
    if "scaled_dot_product" in name:
        return "SDPA"
    if name.startswith("## Call CompiledFxGraph"):
        return "inductor kernels"
    if "gloo" in name or name.startswith("c10d::"):
        return "collectives"
    parent = ev
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return "optimizer"
        parent = parent.cpu_parent
    if name.removeprefix("aten::") in _OPTIMIZER_OPS:
        return "optimizer"
    return "other aten"


def profile_steps(step, n: int) -> dict[str, float]:
    """Run `step()` n times under torch.profiler -> category -> seconds per step (the median
    over the n steps of each step's self times scaled to its process CPU time), plus `step`
    (the median step CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    per_step = []
    for _ in range(n):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            cpu = time.process_time()
            step()
            cpu = time.process_time() - cpu
        events = [(category(ev), ev.self_cpu_time_total / 1e6) for ev in prof.events()]
        # a collective's self time is mostly the wait for the other ranks (no CPU): kept in
        # wall seconds, and left out of the time scaled to the step's CPU time
        total = sum(t for cat, t in events if cat != "collectives") or 1.0
        by = collections.Counter()
        for cat, t in events:
            by[cat] += t if cat == "collectives" else t / total * cpu
        by["step"] = cpu
        per_step.append(by)
    return {k: statistics.median(s[k] for s in per_step) for k in (*CATEGORIES, "step")}


def gemm_floor(step) -> dict[str, float]:
    """Run `step()` once recording its GEMM and SDPA calls (a dispatch mode: eager steps only,
    dynamo runs nothing compiled under one), then replay each alone -> {"GEMM": s, "SDPA": s},
    the minimum CPU time of 3 runs summed over the calls."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    def spec(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", a.shape, a.stride(), a.dtype)
        return a

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in GEMMS or "scaled_dot_product" in name:
                calls.append((func, [spec(a) for a in args], kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Record():
        step()
    floor = collections.Counter()
    for func, specs, kwargs in calls:
        args = [
            torch.empty_strided(s[1], s[2], dtype=s[3]).normal_()
            if isinstance(s, tuple) and s and s[0] == "tensor"
            else s
            for s in specs
        ]
        best = float("inf")
        for _ in range(3):
            cpu = time.thread_time()
            func(*args, **kwargs)
            best = min(best, time.thread_time() - cpu)
        floor["SDPA" if "scaled_dot_product" in func.__name__ else "GEMM"] += best
    return dict(floor)


def table(eager: dict[str, float], compiled: dict[str, float]) -> list[str]:
    """A markdown table of the categories, ms per step, eager and compiled."""
    out = ["| category | eager ms | compiled ms |", "|---|---|---|"]
    for name in (*CATEGORIES, "step"):
        out.append(f"| {name} | {eager[name] * 1e3:.0f} | {compiled[name] * 1e3:.0f} |")
    return out
