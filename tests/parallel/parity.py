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
    # the memory tracker sees every op (~40% of a 6-step run here): tests of mem/* set it back
    "log.memory_steps=0",
]


# loss-parity tables train 6 steps: step 1 is held tightly (assert_parity), and past warmup the
# sharded optimizer's updates and the gathered weights have shown in 4 more; checkpoint and
# resume tests keep TINY's 20 (they save at step 10)
SHORT_STEPS = 6
SHORT = (f"train.steps={SHORT_STEPS}",)


# document masking on the structured dataset's EOD variant (token 249 ends every document)
DOCS = ["data.eod_token_id=249", "data.reset_attention_mask=true", "data.reset_position_ids=true"]


def structured_dataset(eod: int | None = None) -> str:
    """A learnable indexed dataset (documents are arithmetic progressions mod 249, so token 249
    of the 250 is unused), built once per test session with numpy only; returns its prefix.
    eod: a variant (its own files) whose every document ends with token `eod`."""
    import os
    import tempfile

    import numpy as np

    from megatron_lite.data import IndexedDatasetBuilder

    name = "seq" if eod is None else f"seq_eod{eod}"
    prefix = os.path.join(tempfile.gettempdir(), f"megatron_lite_parity_{os.getpid()}", name)
    if not os.path.exists(prefix + ".idx"):
        rng = np.random.default_rng(0)
        with IndexedDatasetBuilder(prefix) as builder:
            for _ in range(400):
                start, step, n = rng.integers(0, 249), rng.integers(1, 7), rng.integers(20, 90)
                doc = (start + step * np.arange(n)) % 249
                builder.add_document(doc if eod is None else np.append(doc, eod))
    return prefix


def _train(rank, world, overrides, out_dir, env=None, keys=None):
    """Train on this rank; rank 0 returns the losses, or the records' `keys` per step."""
    import os

    os.environ.update(env or {})  # before megatron_lite (and triton) are imported here
    import torch.distributed as dist

    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.resolve import rank_layout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    mesh = ParallelMesh(rank_layout(p, world))
    records = Trainer(cfg, mesh, dataset, vocab).train()
    if dist.get_rank() != 0:
        return None
    if keys is None:
        return Curve([r["loss"] for r in records], [r["grad_norm"] for r in records])
    return [{k: r[k] for k in keys if k in r} for r in records]


class Curve(list):
    """Rank 0's per-step losses (the list itself) and their gradient norms (`grad_norms`,
    before clipping)."""

    def __init__(self, losses, grad_norms):
        super().__init__(losses)
        self.grad_norms = list(grad_norms)


def train_losses(
    world: int,
    overrides: list[str],
    tmp: str,
    timeout: float = 180,
    env: dict | None = None,
    eod: int | None = None,
) -> Curve:
    """Rank 0's per-step losses and grad norms; `env` is set in each rank before anything is
    imported; eod: train on `structured_dataset(eod)`."""
    data = f"data.paths=[{structured_dataset(eod)}]"
    return run_ranks(world, _train, [*TINY, data, *overrides], tmp, env, timeout=timeout)[0]


def train_records(
    world: int, overrides: list[str], keys, timeout: float = 180, eod: int | None = None
) -> list[dict]:
    """Rank 0's per-step records, restricted to `keys` (those a step reports); eod: on
    `structured_dataset(eod)`."""
    import tempfile

    data = f"data.paths=[{structured_dataset(eod)}]"
    with tempfile.TemporaryDirectory() as tmp:
        args = [*TINY, data, *overrides]
        return run_ranks(world, _train, args, tmp, None, tuple(keys), timeout=timeout)[0]


@functools.cache
def reference_losses(overrides: tuple[str, ...], eod: int | None = None) -> Curve:
    """Single-rank losses and grad norms for a model config (cached across tests in one
    session: never modify the result); eod: on `structured_dataset(eod)`."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return train_losses(1, list(overrides), tmp, eod=eod)


def max_rel_diff(a, b) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def rel_diffs(a, b) -> list[float]:
    assert len(a) == len(b), (len(a), len(b))
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


# Parity bounds (README "Tests"). Step 1 runs the same weights on the same batch, so a layout
# differs from one rank only by the order of fp32 sums, where a missing or doubled reduction is
# off by orders of magnitude; later steps add the growth of that noise through AdamW. Measured
# over all 42 parity layouts under ATEN_CPU_CAPABILITY=avx512, avx2 and default: step 1 loss
# <= 6.4e-8 and grad norm <= 1.5e-8 relative, later losses (to step 10) <= 3.1e-7, so the bounds
# leave ~8x, ~30x and ~300x (another CPU amplifies rounding differently, up to ~20x measured).
STEP1_LOSS, STEP1_GRAD_NORM, LATER = 5e-7, 5e-7, 1e-4


def assert_parity(got, ref, label: str, later: float = LATER) -> None:
    """`got` (a Curve, or records with loss and grad_norm) matches the single-rank `ref`: step 1's
    loss and gradient norm to STEP1_*, every later loss to `later` (relative)."""
    losses, ref_losses = _series(got, "loss"), _series(ref, "loss")
    norms, ref_norms = _series(got, "grad_norm"), _series(ref, "grad_norm")
    d_loss, d_norm = (
        rel_diffs(losses[:1], ref_losses[:1])[0],
        rel_diffs(norms[:1], ref_norms[:1])[0],
    )
    d_later = max(rel_diffs(losses[1:], ref_losses[1:]), default=0.0)
    print(f"PARITY {label}: step 1 loss {d_loss:.1e} grad norm {d_norm:.1e}; later {d_later:.1e}")
    assert d_loss < STEP1_LOSS, f"{label}: step 1 loss differs by {d_loss:.2e} (relative)"
    assert d_norm < STEP1_GRAD_NORM, f"{label}: step 1 grad norm differs by {d_norm:.2e}"
    assert d_later < later, (
        f"{label}: a later loss differs by {d_later:.2e} (relative)\n{losses}\n{ref_losses}"
    )


def _series(run, key: str) -> list[float]:
    if isinstance(run, Curve):
        return list(run) if key == "loss" else run.grad_norms
    return [r[key] for r in run]
