"""Config validation: every divisibility and range rule, checked before any process group
exists. Each `ConfigError` names the key, its value, the rule and a fix."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.resolve import resolve
from megatron_lite.validation.activation_offload import _validate_activation_offload
from megatron_lite.validation.backends import _validate_fp8, check_hardware
from megatron_lite.validation.compile import _validate_compile
from megatron_lite.validation.data_parallel import _validate_data_parallel
from megatron_lite.validation.fields import (
    _validate_choices,
    _validate_dropout_and_schedule,
    _validate_model_ranges,
    _validate_positive_sizes,
    _validate_train_ranges,
)
from megatron_lite.validation.inactive import config_warnings
from megatron_lite.validation.inputs import (
    _validate_checkpointing,
    _validate_data,
    _validate_documents,
    _validate_eval,
)
from megatron_lite.validation.log import _validate_log
from megatron_lite.validation.memory_checkpoints import _validate_memory_checkpoints
from megatron_lite.validation.moe import _validate_moe
from megatron_lite.validation.mtp import _validate_mtp
from megatron_lite.validation.parallel import (
    _validate_batch_sizes,
    _validate_ffn_hidden_size,
    _validate_heads,
    _validate_order,
    _validate_pipeline_layers,
    _validate_sequence_split,
    _validate_world_size,
)
from megatron_lite.validation.paths import _validate_output_paths
from megatron_lite.validation.profiling import _validate_profiling
from megatron_lite.validation.recompute import _validate_recompute
from megatron_lite.validation.resilience import _validate_resilience
from megatron_lite.validation.rules import show_warnings
from megatron_lite.validation.stored import _validate_model_dtypes

__all__ = ["check_hardware", "config_warnings", "validate"]


def validate(cfg: Config, world_size: int, warn: bool = True) -> Config:
    """Check every rule before any process group exists; raises ConfigError naming key, value,
    rule and fix. Checks only: `cfg` is not changed. Returns `resolve(cfg, world_size)`, the
    copy with the derived fields (parallel.dp, model.ffn_hidden_size, model.num_query_groups)
    filled in. `warn`: a valid config's keys that have no effect in this run are printed as
    one `warning:` line each, once per run (`config_warnings`; a search over many candidate
    layouts passes False)."""
    # the order decides which error a config breaking several rules reports first
    _validate_choices(cfg)
    _validate_positive_sizes(cfg)
    _validate_world_size(cfg.parallel, world_size)
    r = resolve(cfg, world_size)  # the later rules check what will actually run
    _validate_order(r.parallel)
    _validate_heads(r)
    _validate_sequence_split(r)
    _validate_pipeline_layers(r)
    _validate_batch_sizes(r)
    _validate_moe(r)
    _validate_mtp(r)
    _validate_recompute(r)
    _validate_activation_offload(r)
    _validate_ffn_hidden_size(r)
    _validate_data_parallel(r)
    _validate_dropout_and_schedule(r.model, r.train)
    _validate_checkpointing(r.train)
    _validate_memory_checkpoints(r, world_size)
    _validate_model_ranges(r)
    _validate_model_dtypes(r)
    _validate_train_ranges(r)
    _validate_fp8(r)
    _validate_compile(r)
    _validate_data(r)
    _validate_documents(r)
    _validate_eval(r)
    _validate_output_paths(r)
    _validate_log(r)
    _validate_resilience(r)
    _validate_profiling(r)
    if warn:
        show_warnings(config_warnings(r))
    return r
