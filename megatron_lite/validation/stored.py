"""Model floats checked in the dtype the model holds them in: a value finite in float64 (the
config's) can be inf in fp32, and a small positive one can round to 0 there."""

from __future__ import annotations

import torch

from megatron_lite.config import Config
from megatron_lite.validation.rules import _stored


def _validate_model_dtypes(cfg: Config) -> None:
    m = cfg.model
    weights = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    _stored(
        "model.init_method_std",
        m.init_method_std,
        weights,
        "the weights it draws",
        "use e.g. 0.02",
    )
    _stored("model.norm_eps", m.norm_eps, torch.float32, "the norms' math", "use e.g. 1e-5")
