"""An optimizer the project never saw, registered here alone: SGD with momentum as an elementwise
`OptimizerSpec` (one fp32 state per parameter). It trains under ZeRO 0, 1, 2 and 3 (dp2, the
encoder of tests/parallel/encoder_model.py through the public `build_data_parallel`) with the
losses of `torch.optim.SGD(momentum=...)` on one rank; its state appears in the memory report
as 4 bytes per parameter (a hand count); and a checkpoint saved by the trainer on dp2 ZeRO-1
resumes on dp2 ZeRO-3 and on one rank with the losses of an uninterrupted run.

Tolerances: step 1 runs the same weights on the same batch, so the layouts differ only by the
order of fp32 sums (measured <= 6.4e-9 relative, bound 1e-6); SGD does not amplify that noise
the way AdamW's first sign-like steps do, so later steps stay close (measured <= 4.9e-8 over 10
steps and 4.3e-8 over a resumed 20, bound 1e-5). A resume that loses the momentum (states not
loaded) is 9.3e-4 off (measured).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.parallel.data_parallel.optimizer_spec import (
    OptimizerSpec,
    StateSpec,
    optimizer_names,
    register_optimizer,
)
from tests.dist_harness import run_ranks
from tests.parallel import encoder_model as enc
from tests.parallel.parity import TINY, structured_dataset

LR, MOMENTUM = 0.05, 0.9
STEP1_TOL, LATER_TOL = 1e-6, 1e-5


def sgd_momentum(param, grad, state, group) -> None:
    """torch.optim.SGD's update with dampening 0, no weight decay, no Nesterov: b <- m·b + g
    (b starts at 0, so its first value is g, as torch's clone), p <- p - lr·b."""
    buf = state["momentum_buffer"]
    buf.mul_(group["momentum"]).add_(grad)
    param.add_(buf, alpha=-group["lr"])


TOY = OptimizerSpec(
    name="toy_sgd",
    states=(StateSpec("momentum_buffer", torch.float32),),
    hyperparameters={"lr": LR, "momentum": 0.5},  # the runs pass MOMENTUM: optimizer_args
    update=sgd_momentum,
)
if "toy_sgd" not in optimizer_names():  # each forked rank imports this module again
    register_optimizer(TOY)


def reference(rank: int, world: int) -> list[tuple[float, float]]:
    """(loss, grad norm) per step on one rank with torch.optim.SGD and the clipping written
    out (encoder_model.reference with SGD)."""
    mesh, model = enc._setup(world, tp=1)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, foreach=False)
    out = []
    for _ in range(enc.STEPS):
        loss = enc._global_loss(mesh, enc._loss_sum(mesh, model))
        norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params]
        norm = torch.linalg.vector_norm(torch.stack(norms)).item()
        if norm > enc.MAX_NORM:
            for p in params:
                p.grad.mul_(enc.MAX_NORM / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss, norm))
    return out


def train(rank: int, world: int, zero_stage: int) -> dict:
    """(loss, grad norm) per step through build_data_parallel(optimizer="toy_sgd") on dp=world,
    with this rank's optimizer bytes before and after the steps and the parameter count."""

    from megatron_lite.parallel.data_parallel import build_data_parallel

    mesh, model = enc._setup(world, tp=1)
    params = sum(p.numel() for p in model.parameters())
    dp = build_data_parallel(
        [model], mesh, zero_stage=zero_stage, optimizer="toy_sgd", lr=LR,
        optimizer_args={"momentum": MOMENTUM}, bucket_size=2000,  # several buckets
        layers_of=lambda chunk: chunk.blocks,
    )  # fmt: skip
    before = dp.memory()["optimizer"]
    out = [enc.dp_step(mesh, model, dp) for _ in range(enc.STEPS)]
    names = sorted(k for s in dp.optimizer.state_shards() for k in s.states)
    memory = {"before": before, "after": dp.memory()["optimizer"]}
    return {"curve": out, "params": params, "memory": memory, "states": sorted(set(names))}


@pytest.fixture(scope="module")
def single_rank():
    return run_ranks(1, reference, timeout=60)[0]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_toy_optimizer_trains_under_every_stage(single_rank, zero_stage):
    """ZeRO-`zero_stage` dp2 with the toy spec follows torch.optim.SGD on one rank, and its
    memory report holds exactly one fp32 momentum per parameter (4 bytes, summed over the
    ranks that each hold a share, or on each rank under ZeRO-0)."""
    ref = single_rank
    assert ref[-1][0] < ref[0][0] - 0.1, f"the encoder does not learn with SGD: {ref}"
    ranks = run_ranks(2, train, zero_stage, timeout=120)
    got = ranks[0]["curve"]
    step1 = max(_rel(got[0][i], ref[0][i]) for i in (0, 1))
    later = max(_rel(g[0], r[0]) for g, r in zip(got[1:], ref[1:], strict=True))
    print(f"TOY SGD ZeRO-{zero_stage} dp2 vs torch SGD: step 1 {step1:.1e}, later {later:.1e}")
    assert step1 < STEP1_TOL, f"step 1 differs: {got[0]} vs {ref[0]}"
    assert later < LATER_TOL, f"ZeRO-{zero_stage} losses diverge: {got} vs {ref}"
    hand = 4 * ranks[0]["params"]  # one fp32 momentum per parameter
    after = [r["memory"]["after"] for r in ranks]
    assert ranks[0]["states"] == ["momentum_buffer"], ranks[0]["states"]
    if zero_stage == 0:
        assert after == [hand, hand], f"ZeRO-0: {after} bytes, hand count {hand} each"
    else:
        assert sum(after) == hand, f"ZeRO-{zero_stage}: {after} bytes, hand count {hand} in all"
    if zero_stage < 3:  # stages 0-2 make the states before step 1 (ZeRO-3: at the first step)
        assert [r["memory"]["before"] for r in ranks] == after


def test_formula_counts_the_spec_state_bytes():
    """formula_bytes' optimizer term is the spec's state bytes (4 for the toy, 8 for AdamW,
    the ZeRO paper's K = 12 less the fp32 master it counts apart) over the sharding degree."""
    from megatron_lite.parallel.data_parallel.memory import formula_bytes
    from megatron_lite.parallel.data_parallel.optimizer_spec import ADAMW

    psi, n = 1_000_000, 4
    for stage in (0, 1, 2, 3):
        share = psi / n if stage else psi
        toy = formula_bytes(psi, "bf16", stage, n, optimizer=TOY)
        adamw = formula_bytes(psi, "bf16", stage, n, optimizer=ADAMW)
        assert toy["optimizer"] == 4 * share and adamw["optimizer"] == 8 * share, stage
        assert {k: v for k, v in toy.items() if k != "optimizer"} == {
            k: v for k, v in adamw.items() if k != "optimizer"
        }, f"stage {stage}: only the optimizer term depends on the spec"


def _train_trainer(rank, world, overrides, out_dir):
    """The trainer on this rank (this module imported: the toy is registered); rank 0 returns
    (losses, mem/optimizer of the first step)."""
    from tests.parallel.parity import _train

    records = _train(rank, world, overrides, out_dir, keys=("loss", "mem/optimizer"))
    return None if records is None else [r["loss"] for r in records]


def _trainer(world: int, overrides: list[str], out_dir: str) -> list[float]:
    data = f"data.paths=[{structured_dataset()}]"
    toy = [
        "train.optimizer=toy_sgd",
        "train.weight_decay=0",
        "train.optimizer_args={momentum: 0.9}",
    ]
    args = [*TINY, data, *toy, *overrides]
    return run_ranks(world, _train_trainer, args, out_dir, timeout=240)[0]


@pytest.mark.slow  # 7 s (the suite's budget); Muon's resharded resume is in the slow tier too
def test_toy_optimizer_resumes_resharded(tmp_path):
    """train.optimizer=toy_sgd: save at step 10 on dp2 ZeRO-1, resume on dp2 ZeRO-3 and on one
    rank: steps 11-20 give the losses of the uninterrupted one-rank run (the checkpoint holds
    optim/momentum_buffer/... as logical per-parameter tensors); resuming it with AdamW is
    refused, naming the optimizer that saved it."""
    straight = _trainer(1, [], str(tmp_path / "straight"))
    first = str(tmp_path / "first")
    save = ["train.save_interval=10", "train.steps=10", "train.lr_decay_steps=20"]
    head = _trainer(2, ["parallel.zero_stage=1", *save], first)
    resume = f"train.resume={first}/checkpoints/step_10"
    for name, world, layout in (("zero3_dp2", 2, ["parallel.zero_stage=3"]), ("dp1", 1, [])):
        tail = _trainer(world, [*layout, resume], str(tmp_path / name))
        got = head + tail
        diff = max(_rel(g, r) for g, r in zip(got, straight, strict=True))
        print(f"TOY SGD resume ZeRO-1 dp2 -> {name}: max rel diff {diff:.2e}")
        assert diff < LATER_TOL, f"{name}: resumed losses differ by {diff:.2e}\n{got}\n{straight}"
    with pytest.raises(RuntimeError, match="train.optimizer='adamw' but checkpoint .* holds the "
                       "state of 'toy_sgd'. Fix: set train.optimizer='toy_sgd'"):  # fmt: skip
        _trainer(
            1, [resume, "train.optimizer=adamw", "train.optimizer_args={}"], str(tmp_path / "x")
        )
