"""Keys of a feature this run does not use: a valid value other than the default gets a one-line
warning that it has no effect (an invalid one is an error wherever its rule lives, feature on
or off). `config_warnings(cfg)` lists them for the resolved config; `validate` shows them once
(rules.show_warnings)."""

from __future__ import annotations

import dataclasses

from megatron_lite.config import Config, DataConfig
from megatron_lite.models.registry import get_architecture
from megatron_lite.parallel.fp8 import LOCAL_RECIPES
from megatron_lite.resolve import uses_documents
from megatron_lite.validation.data_parallel import optimizer_warnings
from megatron_lite.validation.moe import moe_warnings
from megatron_lite.validation.mtp import mtp_warnings
from megatron_lite.validation.parallel import parallel_warnings
from megatron_lite.validation.resilience import resilience_warnings
from megatron_lite.validation.rules import _no_effect


def config_warnings(cfg: Config) -> list[str]:
    """Every warning of the resolved config `cfg`, in section order."""
    return [
        *_model_warnings(cfg),
        *moe_warnings(cfg.model),
        *mtp_warnings(cfg.model),
        *parallel_warnings(cfg),
        *_data_warnings(cfg.data),
        *_train_warnings(cfg),
        *_log_warnings(cfg),
        *resilience_warnings(cfg),
    ]


def _changed(section, names) -> list[str]:
    """The names among `names` whose value in `section` differs from the dataclass default."""
    default = type(section)()
    return [n for n in names if getattr(section, n) != getattr(default, n)]


def _each(section: str, obj, names, why: str, fix: str) -> list[str]:
    return [_no_effect(f"{section}.{n}", getattr(obj, n), why, fix) for n in _changed(obj, names)]


def _model_warnings(cfg: Config) -> list[str]:
    m, t = cfg.model, cfg.train
    out = []
    for key, why, fix in get_architecture(m.arch).unused_keys:  # e.g. gpt's rope_theta
        out += _each("model", m, [key], why, fix)
    if m.fp8 is None or m.fp8 in LOCAL_RECIPES:
        why = "model.fp8 is null" if m.fp8 is None else f"model.fp8={m.fp8!r} is its own recipe"
        out += _each("model", m, ["fp8_recipe"], why, "remove the key (TE FP8 only)")
    if m.fp8 not in LOCAL_RECIPES:
        out += _each(
            "model",
            m,
            ["fp8_skip", "fp8_unaligned", "fp8_all_gather"],
            "they apply to local FP8 (model.fp8=tensorwise|rowwise)",
            "set model.fp8=tensorwise|rowwise, or remove the key",
        )
    if t.precision == "fp32":
        out += _each(
            "model",
            m,
            ["fp32_residual_connection"],
            "train.precision=fp32 keeps the residual stream in fp32 anyway",
            "remove it, or set train.precision=bf16",
        )
    if m.recompute_granularity != "selective":
        out += _each(
            "model",
            m,
            ["recompute_modules"],
            f"model.recompute_granularity={m.recompute_granularity} (the list is for selective)",
            "set model.recompute_granularity=selective, or remove the key",
        )
    return out


# the data keys that mock data ignores (it draws tokens from model.vocab_size)
_SOURCE_KEYS = (
    "paths",
    "weights",
    "tokenizer_model",
    "corpus",
    "split",
    "valid_paths",
    "index_cache_dir",
    "cache_dir",
    "tokenizer_vocab_size",
)


def _data_warnings(d: DataConfig) -> list[str]:
    out = []
    if d.eod_token_id is not None and not uses_documents(d):
        out.append(
            _no_effect(
                "data.eod_token_id",
                d.eod_token_id,
                "no document masking is on (data.reset_attention_mask, reset_position_ids, "
                "eod_mask_loss)",
                "turn one of them on, or remove the key",
            )
        )
    if d.mock:
        why = "data.mock=true draws random tokens (no data files, tokenizer or split)"
        return _each("data", d, _SOURCE_KEYS, why, "remove it, or set data.mock=false") + out
    if d.corpus is None:
        out += _each(
            "data",
            d,
            ["cache_dir", "tokenizer_vocab_size"],
            "they are for a built-in corpus (data.corpus is null)",
            "remove it, or set data.corpus",
        )
    else:
        out += _each(
            "data",
            d,
            ["tokenizer_model"],
            f"data.corpus={d.corpus} trains its own tokenizer",
            "remove it, or use data.paths made with that tokenizer",
        )
    if d.weights is not None and len(d.paths) == 1:
        out.append(_no_effect("data.weights", d.weights, "one dataset is not blended", "remove it"))
    return out


def _train_warnings(cfg: Config) -> list[str]:
    t = cfg.train
    out = []
    if t.save_interval == 0:
        out += _each(
            "train",
            t,
            ["async_save", "async_save_timeout_s", "keep_checkpoints"],
            "train.save_interval=0 saves no checkpoint",
            "set train.save_interval, or remove the key",
        )
    if t.eval_interval == 0:
        out += _each(
            "train",
            t,
            ["eval_iters"],
            "train.eval_interval=0 never evaluates",
            "set train.eval_interval, or remove the key",
        )
    return out + optimizer_warnings(cfg)


def _log_warnings(cfg: Config) -> list[str]:
    out = []
    if not cfg.log.wandb:
        out += _each(
            "log",
            cfg.log,
            [f.name for f in dataclasses.fields(cfg.log) if f.name.startswith("wandb_")],
            "log.wandb is false",
            "set log.wandb=true, or remove the key",
        )
    if not cfg.log.tensorboard:
        out += _each(
            "log",
            cfg.log,
            ["tensorboard_dir"],
            "log.tensorboard is false",
            "set log.tensorboard=true, or remove the key",
        )
    return out
