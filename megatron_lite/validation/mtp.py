"""Multi-token prediction's rules (model.mtp_num_layers, model.mtp_loss_scaling_factor;
models/mtp.py) and the warning when its scaling factor is set with MTP off."""

from __future__ import annotations

import math

from megatron_lite.config import Config, ModelConfig
from megatron_lite.models.registry import get_architecture
from megatron_lite.validation.rules import _no_effect, _rule


def _validate_mtp(cfg: Config) -> None:
    m = cfg.model
    _rule(
        isinstance(m.mtp_num_layers, int) and m.mtp_num_layers >= 0,
        "model.mtp_num_layers",
        m.mtp_num_layers,
        "must be an integer >= 0 (the number of MTP modules; 0 = off)",
        "use 0 (off) or e.g. 1 (DeepSeek-V3)",
    )
    factor = m.mtp_loss_scaling_factor
    _rule(
        isinstance(factor, int | float) and math.isfinite(factor) and factor >= 0,
        "model.mtp_loss_scaling_factor",
        factor,
        "must be a finite number >= 0 (λ: the objective adds λ/D · Σ_k MTP loss_k)",
        "use e.g. 0.1 (Megatron's default; DeepSeek-V3: 0.3, then 0.1)",
    )
    if m.mtp_num_layers:
        arch = get_architecture(m.arch)
        _rule(
            not arch.learned_positions,
            "model.mtp_num_layers",
            m.mtp_num_layers,
            f"model.arch={m.arch} adds learned absolute positions to the embedding, which the "
            "MTP modules' shifted embeddings have no rule for (Megatron-Core allows MTP with "
            "rope or no position embedding only)",
            "use an architecture with rotary positions (e.g. model.arch=llama), or "
            "model.mtp_num_layers=0",
        )
    _rule(
        m.mtp_num_layers < m.seq_length,
        "model.mtp_num_layers",
        m.mtp_num_layers,
        f"must be < model.seq_length={m.seq_length}: module k predicts the token k + 1 "
        "positions ahead, inside the window",
        "use fewer MTP modules or a longer sequence",
    )


def mtp_warnings(m: ModelConfig) -> list[str]:
    """model.mtp_loss_scaling_factor changed while MTP is off."""
    if m.mtp_num_layers or m.mtp_loss_scaling_factor == ModelConfig().mtp_loss_scaling_factor:
        return []
    return [
        _no_effect(
            "model.mtp_loss_scaling_factor",
            m.mtp_loss_scaling_factor,
            "model.mtp_num_layers=0 (no multi-token prediction)",
            "set model.mtp_num_layers >= 1, or remove the key",
        )
    ]
