"""Profiler rules: train.profile_steps is [] or two step numbers a <= b inside the run."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.validation.rules import _rule


def _validate_profiling(cfg: Config) -> None:
    t = cfg.train
    steps = t.profile_steps
    _rule(
        len(steps) in (0, 2),
        "train.profile_steps",
        steps,
        "must be [] (off) or two step numbers [first, last]",
        "give e.g. train.profile_steps=[2,3] (0-based steps, as in metrics.jsonl)",
    )
    if steps:
        a, b = steps
        _rule(
            0 <= a <= b < t.steps,
            "train.profile_steps",
            steps,
            f"needs 0 <= first <= last < train.steps={t.steps} (steps are 0-based)",
            f"use steps between 0 and {t.steps - 1}, e.g. "
            f"train.profile_steps=[{min(1, t.steps - 1)},{min(2, t.steps - 1)}]",
        )
    _rule(
        not t.profile_memory_snapshot or bool(steps),
        "train.profile_memory_snapshot",
        t.profile_memory_snapshot,
        "records the allocator over train.profile_steps, which is empty",
        "set train.profile_steps=[first,last] as well, or profile_memory_snapshot=false",
    )


def check_profile_hardware(cfg: Config, cuda: bool) -> None:
    """The CUDA allocator snapshot needs a GPU."""
    _rule(
        cuda or not cfg.train.profile_memory_snapshot,
        "train.profile_memory_snapshot",
        True,
        "snapshots the CUDA allocator, and this machine has no CUDA device",
        "set train.profile_memory_snapshot=false (the profiler trace still has the memory "
        "timeline)",
    )
