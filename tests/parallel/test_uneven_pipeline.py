"""Uneven pipeline splits (parallel.pipeline_layers, decoder_first/last_pipeline_num_layers) give
the single-rank losses; the simulator weighs each virtual stage by its layers; bad splits are
config errors."""

from fractions import Fraction

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.pipeline.schedules import get_schedule_table
from megatron_lite.pipeline.simulate import simulate
from megatron_lite.resolve import stage_layers
from megatron_lite.validation import validate
from tests.parallel.parity import SHORT, assert_parity, reference_losses, train_losses

LLAMA = ("model.arch=llama",)  # TINY: 4 layers
BOTH_ENDS_1_2 = ("parallel.decoder_first_pipeline_num_layers=1",
                 "parallel.decoder_last_pipeline_num_layers=2")  # fmt: skip


@pytest.mark.parity
@pytest.mark.parametrize(
    "world, split",
    [
        (2, ["parallel.pp=2", "parallel.pipeline_layers=[1,3]"]),
        (3, ["parallel.pp=3", "parallel.decoder_first_pipeline_num_layers=2"]),
    ],
)
def test_uneven_split_matches_one_rank(world, split, tmp_path):
    ref = reference_losses((*LLAMA, *SHORT))
    got = train_losses(world, [*LLAMA, *SHORT, *split], str(tmp_path))
    assert_parity(got, ref, f"uneven {split}")


def test_simulator_weighs_stages_by_their_layers():
    table = get_schedule_table(2, 4)
    even = simulate(table, stage_weights=[2, 2])
    uneven = simulate(table, stage_weights=[1, 3])
    assert even.makespan == 2 * simulate(table).makespan
    assert uneven.makespan > even.makespan  # the heavy last stage is the bottleneck
    busy_last = sum(
        s.end - s.start for s in uneven.spans if s.rank == 1 and s.kind in ("forward", "backward")
    )
    assert busy_last == 4 * 3 * (1 + 2) and isinstance(uneven.makespan, int | Fraction)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["parallel.pp=2", "parallel.pipeline_layers=[1,2]"], "must add up to model.num_layers=4"),
        (["parallel.pp=2", "parallel.pipeline_layers=[4]"], "one entry per virtual stage"),
        (["parallel.pp=2", "parallel.pipeline_layers=[0,4]"], "at least one layer"),
        (["parallel.pp=3", "parallel.decoder_last_pipeline_num_layers=1"], "split them evenly"),
        (["parallel.pp=3"], "parallel.pipeline_layers or"),
        (["parallel.pp=2", *BOTH_ENDS_1_2], r"\+ decoder_last = 3"),
        (["parallel.pp=1", "parallel.decoder_first_pipeline_num_layers=2"], "at least two stages"),
    ],
)
def test_bad_splits_are_config_errors(overrides, needle):
    cfg = _config(overrides)
    world = {"parallel.pp=1": 1, "parallel.pp=2": 2}.get(overrides[0], 3)
    with pytest.raises(ConfigError, match=needle) as e:
        validate(cfg, world)
    assert "Fix:" in str(e.value)


def _config(overrides):
    return load_config(None, ["data.mock=true", "model.vocab_size=64", "model.num_layers=4",
                              "train.global_batch_size=12", *overrides])  # fmt: skip


def test_both_ends_given_on_two_stages_are_the_whole_split():
    """pp=2 with decoder_first and decoder_last set: the two numbers are the split (Megatron
    accepts it; validation must not ask for middle stages that do not exist)."""
    cfg = _config(["parallel.pp=2", "parallel.decoder_first_pipeline_num_layers=1",
                   "parallel.decoder_last_pipeline_num_layers=3"])  # fmt: skip
    validate(cfg, 2)
    assert stage_layers(cfg.model, cfg.parallel) == [1, 3]
