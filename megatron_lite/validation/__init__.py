"""Config validation: every divisibility and range rule, checked before any process group
exists. Each `ConfigError` names the key, its value, the rule and a fix."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.validation.backends import _validate_fp8, check_hardware
from megatron_lite.validation.fields import (
    _validate_choices,
    _validate_dropout_and_schedule,
    _validate_model_ranges,
    _validate_positive_sizes,
    _validate_train_ranges,
)
from megatron_lite.validation.inputs import _validate_checkpointing, _validate_data
from megatron_lite.validation.moe import _validate_moe
from megatron_lite.validation.parallel import (
    _validate_batch_sizes,
    _validate_ffn_hidden_size,
    _validate_heads,
    _validate_order,
    _validate_pipeline_layers,
    _validate_sequence_split,
    _validate_world_size,
    num_microbatches,
)
from megatron_lite.validation.paths import _validate_output_paths

__all__ = ["check_hardware", "num_microbatches", "validate"]


def validate(cfg: Config, world_size: int) -> Config:
    """Check every rule before any process group exists; fills derived values (parallel.dp,
    model.ffn_hidden_size, model.num_query_groups). Raises ConfigError naming key/rule/fix."""
    # the order decides which error a config breaking several rules reports first
    _validate_choices(cfg)
    _validate_positive_sizes(cfg)
    _validate_world_size(cfg.parallel, world_size)
    _validate_order(cfg.parallel)
    _validate_heads(cfg)
    _validate_sequence_split(cfg)
    _validate_pipeline_layers(cfg)
    _validate_batch_sizes(cfg)
    _validate_moe(cfg)
    _validate_ffn_hidden_size(cfg)
    _validate_dropout_and_schedule(cfg.model, cfg.train)
    _validate_checkpointing(cfg.train)
    _validate_model_ranges(cfg.model)
    _validate_train_ranges(cfg)
    _validate_fp8(cfg)
    _validate_data(cfg)
    _validate_output_paths(cfg)
    return cfg
