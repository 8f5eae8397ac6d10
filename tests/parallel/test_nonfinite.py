"""The non-finite guard: a NaN loss or gradient stops the run naming the step, the rank and the
parameter, or skips the step under train.skip_nonfinite_steps."""

import json
import re

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import TINY, structured_dataset


def _train(rank, world, overrides, out_dir, poison):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.nonfinite import NonFiniteError
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    p = cfg.parallel
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world, tp=p.tp, pp=p.pp)), dataset, vocab)
    if poison == "fc1 output grad":  # any stage: the backward through layer 3's fc1 turns NaN
        fc1 = trainer.chunks[-1].layers["3"].mlp.linear_fc1
        nan_grad = lambda g: g * float("nan") if trainer.step >= 2 and rank == world - 1 else g
        fc1.register_forward_hook(lambda m, i, out: out.register_hook(nan_grad) and None)
    elif poison == "loss":  # the last stage's final norm overflows: the loss is NaN
        for chunk in trainer.chunks:
            if chunk.post_process:
                chunk.final_norm.register_forward_hook(lambda m, i, out: out * float("nan"))
    elif poison:  # from step 2 on, one rank's gradient turns NaN (a stand-in for overflow)
        param = dict(trainer.named_params).get(poison)
        if param is not None and rank == world - 1:
            param.register_hook(lambda g: g * float("nan") if trainer.step >= 2 else g)
    try:
        records = trainer.train()
    except NonFiniteError as e:
        return ("stopped", str(e), trainer.step)
    return ("done", [r.get("skipped", False) for r in records], trainer.step)


def _run(tmp_path, extra, poison=None):
    data = f"data.paths=[{structured_dataset()}]"
    args = [*TINY, data, "train.steps=5", "parallel.pp=2", *extra]
    return run_ranks(2, _train, args, str(tmp_path), poison, timeout=120)


def test_nan_loss_stops_naming_step_and_rank(tmp_path):
    results = _run(tmp_path, [], poison="loss")
    for status, message, step in results:
        assert status == "stopped" and step == 0, message
        assert message.startswith("step 1: the loss is nan (on rank 1)"), message  # 1-based
        assert "Fix:" in message and "skip_nonfinite_steps" in message


def test_nan_gradient_names_the_parameter(tmp_path):
    results = _run(tmp_path, [], poison="layers.3.mlp.linear_fc1.weight")
    status, message, step = results[0]
    assert status == "stopped" and step == 2, message
    assert "step 3: the gradient norm is nan: non-finite gradient in " in message
    assert "layers.3.mlp.linear_fc1.weight on rank 1" in message


def _train_each_stage(rank, world, args, out_dir, poison):
    """One launch for every ZeRO stage (a launch costs seconds on 2 cores)."""
    return {
        stage: _train(rank, world, [*args, f"parallel.zero_stage={stage}"], f"{out_dir}/{stage}",
                      poison)
        for stage in (0, 1, 2, 3)
    }  # fmt: skip


def test_nan_gradient_under_every_zero_stage_is_the_named_error(tmp_path):
    """dp2: the guard reads the reduced gradients the wrapper holds (`dp.local_grads()`):
    whole gradients (ZeRO-0), views of the full buffer's shards (ZeRO-1), the persistent shard
    (ZeRO-2, whose buckets are freed after each reduction: reading `main_grad` there crashed
    the process), the FSDP2 shards (ZeRO-3)."""
    args = [*TINY, f"data.paths=[{structured_dataset()}]", "train.steps=4"]
    results = run_ranks(2, _train_each_stage, args, str(tmp_path), "fc1 output grad", timeout=180)
    for rank, by_stage in enumerate(results):
        for stage, (status, message, step) in by_stage.items():
            where = f"ZeRO-{stage} rank {rank}"
            assert status == "stopped" and step == 2, f"{where}: {message}"
            assert message.startswith("step 3: the gradient norm is nan: non-finite gradient in ")
            # the NaN flows back through every earlier layer: the first few are named, per rank
            pattern = r"non-finite gradient in [\w.]+\.weight on rank [01]"
            assert re.search(pattern, message), f"{where}: {message}"


def test_skip_nonfinite_steps_skips_then_stops(tmp_path):
    poison = "layers.3.mlp.linear_fc1.weight"
    status, message, step = _run(tmp_path, ["train.skip_nonfinite_steps=2"], poison)[0]
    assert status == "stopped" and step == 4, message  # steps 2 and 3 skipped, step 4 stops
    assert "3 non-finite steps in a row, more than train.skip_nonfinite_steps=2" in message
    with open(tmp_path / "metrics.jsonl") as f:
        skipped = [json.loads(line).get("skipped", False) for line in f]
    assert skipped == [False, False, True, True], skipped


@pytest.mark.parametrize("value", [-1])
def test_skip_limit_must_be_non_negative(value):
    from megatron_lite.config import ConfigError, load_config
    from megatron_lite.validation import validate

    with pytest.raises(ConfigError, match="train.skip_nonfinite_steps=-1: must be >= 0"):
        validate(
            load_config(
                None,
                ["data.mock=true", "model.vocab_size=64", f"train.skip_nonfinite_steps={value}"],
            ),
            1,
        )
