"""Loss-parity helpers: train the real Trainer on N forked ranks and return rank 0's losses."""

from __future__ import annotations

import functools

from tests.dist_harness import run_ranks

TINY = [
    "model.vocab_size=250",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=20",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "log.progress=false",
    "model.make_vocab_size_divisible_by=8",
]


# loss-parity tables train 10 steps (the loss has fallen well before; start-up dominates the
# rest); checkpoint and resume tests keep TINY's 20 (they save at step 10)
SHORT = ("train.steps=10",)


def structured_dataset() -> str:
    """A learnable indexed dataset (documents are arithmetic progressions mod 250), built once
    per test session with numpy only; returns its prefix."""
    import os
    import tempfile

    import numpy as np

    from megatron_lite.data import IndexedDatasetBuilder

    prefix = os.path.join(tempfile.gettempdir(), f"megatron_lite_parity_{os.getpid()}", "seq")
    if not os.path.exists(prefix + ".idx"):
        rng = np.random.default_rng(0)
        with IndexedDatasetBuilder(prefix) as builder:
            for _ in range(400):
                start, step, n = rng.integers(0, 249), rng.integers(1, 7), rng.integers(20, 90)
                builder.add_document((start + step * np.arange(n)) % 249)
    return prefix


def _train(rank, world, overrides, out_dir, env=None, keys=None):
    """Train on this rank; rank 0 returns the losses, or the records' `keys` per step."""
    import os

    os.environ.update(env or {})  # before megatron_lite (and triton) are imported here
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order))
    records = Trainer(cfg, mesh, dataset, vocab).train()
    if dist.get_rank() != 0:
        return None
    if keys is None:
        return [r["loss"] for r in records]
    return [{k: r[k] for k in keys if k in r} for r in records]


def train_losses(
    world: int, overrides: list[str], tmp: str, timeout: float = 180, env: dict | None = None
) -> list[float]:
    """Rank 0's per-step losses; `env` is set in each rank before anything is imported."""
    data = f"data.paths=[{structured_dataset()}]"
    return run_ranks(world, _train, [*TINY, data, *overrides], tmp, env, timeout=timeout)[0]


def train_records(world: int, overrides: list[str], keys, timeout: float = 180) -> list[dict]:
    """Rank 0's per-step records, restricted to `keys` (those a step reports)."""
    import tempfile

    data = f"data.paths=[{structured_dataset()}]"
    with tempfile.TemporaryDirectory() as tmp:
        args = [*TINY, data, *overrides]
        return run_ranks(world, _train, args, tmp, None, tuple(keys), timeout=timeout)[0]


@functools.cache
def reference_losses(overrides: tuple[str, ...]) -> tuple[float, ...]:
    """Single-rank losses for a model config (cached across tests in one session)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return tuple(train_losses(1, list(overrides), tmp))


def max_rel_diff(a, b) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
