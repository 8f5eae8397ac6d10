"""model.recompute_* and model.fp32_residual_connection: every bad value is a ConfigError that
names the key, the rule and a fix, before any process group; good values reach the frozen
TransformerConfig as resolved."""

import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.validation import validate

BASE = ["data.mock=true", "model.vocab_size=128", "model.num_layers=4"]
FULL = ["model.recompute_granularity=full"]
BAD = [
    (["model.recompute_granularity=partial"], "model.recompute_granularity='partial': must be one"),
    (["model.recompute_granularity=selective", "model.recompute_modules=[]"], "at least one"),
    (
        ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,swiglu]"],
        "'swiglu' is not a module we can recompute",
    ),
    (
        ["model.recompute_granularity=selective", "model.recompute_modules=[mlp,mlp]"],
        "lists a module twice",
    ),
    (["model.recompute_granularity=selective", "model.recompute_modules=[moe]"], "dense model"),
    (["model.recompute_method=uniform"], "only used with model.recompute_granularity=full"),
    (["model.recompute_num_layers=1"], "model.recompute_num_layers=1: is only used"),
    (FULL, "model.recompute_method=None: model.recompute_granularity=full needs a method"),
    ([*FULL, "model.recompute_method=chunked"], "model.recompute_method='chunked': must be one"),
    ([*FULL, "model.recompute_method=uniform"], "model.recompute_num_layers=None"),
    ([*FULL, "model.recompute_method=block", "model.recompute_num_layers=0"], "1 .. 4"),
    # 2 layers per stage under pp=2
    ([*FULL, "model.recompute_method=block", "model.recompute_num_layers=3", "parallel.pp=2"],
     "recompute_num_layers <= 2"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,needle", BAD)
def test_bad_recompute_config_is_rejected(overrides, needle):
    world = 2 if "parallel.pp=2" in overrides else 1
    with pytest.raises(ConfigError, match="Fix: ") as e:
        validate(load_config(None, [*BASE, *overrides]), world)
    assert needle in str(e.value), str(e.value)


def test_resolved_into_transformer_config():
    full = [*FULL, "model.recompute_method=block", "model.recompute_num_layers=2"]
    cfg = validate(load_config(None, [*BASE, *full, "model.fp32_residual_connection=true"]), 1)
    t = TransformerConfig.from_config(cfg, 1)
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == (
        "full",
        "block",
        2,
    )
    assert t.recompute_modules == () and t.fp32_residual_connection  # full: no module list
    sel = ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]"]
    t = TransformerConfig.from_config(validate(load_config(None, [*BASE, *sel]), 1), 1)
    assert t.recompute_modules == ("core_attn", "mlp") and t.recomputes("mlp")
    t = TransformerConfig.from_config(validate(load_config(None, BASE), 1), 1)
    assert t.recompute_granularity is None and not t.recomputes("core_attn")
