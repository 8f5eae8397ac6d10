"""The rules of the resilience keys (docs/resilience.md): the straggler report's interval and
the rerun of a suspicious step."""

from __future__ import annotations

import math

from megatron_lite.config import Config, LogConfig, TrainConfig
from megatron_lite.validation.rules import _choice, _no_effect, _rule

# training/rerun.py's modes (not imported: validation stays free of the training stack)
RERUN_CHOICES = ("none", "nonfinite", "spike", "both")


def _validate_resilience(cfg: Config) -> None:
    """log.straggler_interval >= 1; train.rerun_on one of RERUN_CHOICES; train.spike_factor a
    finite number > 1 (a spike is a value above factor × the recent mean: at <= 1 ordinary
    steps would trigger replays)."""
    log, t = cfg.log, cfg.train
    _rule(
        isinstance(log.straggler_interval, int) and log.straggler_interval >= 1,
        "log.straggler_interval",
        log.straggler_interval,
        "must be an integer >= 1 (steps between straggler reports)",
        "set log.straggler_interval=10, for example",
    )
    _choice("train.rerun_on", t.rerun_on, RERUN_CHOICES)
    factor = t.spike_factor
    _rule(
        isinstance(factor, int | float) and math.isfinite(factor) and factor > 1,
        "train.spike_factor",
        factor,
        "must be a finite number > 1 (a spike is a loss or gradient norm above spike_factor "
        "× the mean of recent steps; at <= 1 ordinary steps would count as spikes)",
        "set train.spike_factor=3.0, for example",
    )


def resilience_warnings(cfg: Config) -> list[str]:
    """log.straggler_interval changed while log.straggler is off; train.spike_factor changed
    while train.rerun_on watches no spikes."""
    out = []
    if not cfg.log.straggler and cfg.log.straggler_interval != LogConfig().straggler_interval:
        out.append(
            _no_effect(
                "log.straggler_interval",
                cfg.log.straggler_interval,
                "log.straggler=false (no straggler report)",
                "set log.straggler=true, or remove the key",
            )
        )
    t = cfg.train
    if t.rerun_on not in ("spike", "both") and t.spike_factor != TrainConfig().spike_factor:
        out.append(
            _no_effect(
                "train.spike_factor",
                t.spike_factor,
                f"train.rerun_on={t.rerun_on!r} watches no spikes",
                "set train.rerun_on=spike or both, or remove the key",
            )
        )
    return out
