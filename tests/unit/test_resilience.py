"""The resilience keys' rules, the straggler report's arithmetic and the rerun's triggers, on
one process (the multi-rank behaviour: tests/parallel/test_resilience.py)."""

import os

import pytest
import torch

from megatron_lite.config import ConfigError, load_config
from megatron_lite.training.logging import MetricsLogger
from megatron_lite.training.rerun import MIN_HISTORY, SPIKE_WINDOW, Attempt, StepRerun
from megatron_lite.training.straggler import relative_speeds, straggler_fields
from megatron_lite.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.spike_factor=1", "train.spike_factor=1.0: must be a finite number > 1"),
        ("train.spike_factor=0.5", "train.spike_factor=0.5: must be a finite number > 1"),
        (
            "train.spike_factor=inf",
            "train.spike_factor='inf': must be a finite number",
        ),  # load_config
        ("log.straggler_interval=0", "log.straggler_interval=0: must be an integer >= 1"),
        ("train.rerun_on=always", "train.rerun_on='always': must be one of none, nonfinite"),
    ],
)
def test_bad_resilience_keys_are_named(override, needle):
    with pytest.raises(ConfigError) as e:
        validate(load_config(SMOKE, [override]), world_size=1, warn=False)
    assert needle in str(e.value) and "Fix:" in str(e.value), str(e.value)


def test_relative_speed_is_the_stage_median_over_the_rank_time():
    # stage 0: ranks of 1 s and 2 s (median 1.5); stage 1: both 1 s
    assert relative_speeds([0, 0, 1, 1], [1.0, 2.0, 1.0, 1.0]) == [1.5, 0.75, 1.0, 1.0]
    # a rank alone in its stage is compared with the world's median (1 s)
    assert relative_speeds([0, 1, 1], [2.0, 1.0, 1.0]) == [0.5, 1.0, 1.0]


def test_straggler_fields_list_the_slowest_first_with_hosts():
    table = [[0, 1.0, 2], [0, 4.0, 2], [0, 1.0, 2], [0, 2.0, 2]]  # median 1.5
    fields = straggler_fields(table, ["a", "b", "c", "d"], top=2)
    assert fields["straggler/min_rel"] == 1.5 / 4.0
    assert fields["straggler/slowest_ranks"] == [
        {"rank": 1, "host": "b", "rel": 0.375},
        {"rank": 3, "host": "d", "rel": 0.75},
    ]


def test_progress_line_names_the_slowest_rank(tmp_path, capsys):
    cfg = load_config(SMOKE, [f"train.out_dir={tmp_path}", "train.steps=1"])
    logger = MetricsLogger(cfg, active=True)
    slowest = [{"rank": 3, "host": "node7", "rel": 0.6}]
    record = {"step": 0, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    record |= {"step_time_s": 0.1, "straggler/min_rel": 0.6, "straggler/slowest_ranks": slowest}
    logger.log(record, 0)
    logger.close()
    assert "| slowest rank 3 (node7) 0.60x |" in capsys.readouterr().out


def _attempt(loss: float, norm: float) -> Attempt:
    zero = torch.zeros((), dtype=torch.float64)
    return Attempt(loss, norm, (zero, zero), [])


def test_triggers_by_mode_and_the_spike_reference():
    cpu = torch.device("cpu")
    off = StepRerun("none", 3.0, cpu)
    assert not off.active and off.metrics() == {}
    nonfinite = StepRerun("nonfinite", 3.0, cpu)
    assert nonfinite.trigger(float("nan"), 1.0) == "non-finite"
    assert nonfinite.trigger(1.0, float("inf")) == "non-finite"
    assert nonfinite.trigger(1e9, 1e9) is None  # spikes are not watched
    spike = StepRerun("spike", 3.0, cpu)
    assert spike.trigger(float("nan"), 1.0) is None  # the guard's business alone
    losses = [5.0, 4.0, 3.0] + [2.0] * SPIKE_WINDOW
    for i, loss in enumerate(losses):
        if i < MIN_HISTORY:  # too few steps for a reference
            assert spike.trigger(1e6, 1e6) is None
        spike._taken(_attempt(loss, 0.5))
    # the reference is the mean of the last SPIKE_WINDOW losses (all 2.0): 6.0 is no spike
    assert spike.trigger(6.0, 0.5) is None
    assert spike.trigger(6.001, 0.5).startswith("loss spike (loss 6.001 > 3 × 2")
    assert spike.trigger(2.0, 1.501).startswith("grad norm spike (grad norm 1.501 > 3 × 0.5")
    both = StepRerun("both", 3.0, cpu)
    assert both.trigger(float("nan"), 1.0) == "non-finite"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("log.straggler_interval=5", "log.straggler_interval=5 has no effect: log.straggler=false"),
        ("train.spike_factor=5", "train.spike_factor=5.0 has no effect: train.rerun_on='none'"),
    ],
)
def test_keys_of_a_feature_that_is_off_warn(override, needle):
    from megatron_lite.validation import config_warnings

    cfg = validate(load_config(SMOKE, [override]), world_size=1, warn=False)
    assert [w for w in config_warnings(cfg) if needle in w], config_warnings(cfg)
    on = "log.straggler=true" if override.startswith("log") else "train.rerun_on=spike"
    cfg = validate(load_config(SMOKE, [override, on]), world_size=1, warn=False)
    assert not [w for w in config_warnings(cfg) if override.split("=")[0] in w]
