"""RoPE scaling (`model.rope_scaling`): YaRN as Hugging Face transformers 5.25 computes it
(modeling_rope_utils `_compute_yarn_parameters` and, for MLA's softmax, `yarn_apply_mscale`), in
float64 here. The one owner of these formulas: the RoPE tables (models/transformer.py
rope_tables_at), MLA's softmax scale (models/mla.py) and the config rules read them.

model.rope_scaling is a mapping as HF's `rope_scaling` / `rope_parameters`:
    type (or rope_type): yarn
    factor: s, the context extension (DeepSeek-V3: 40)
    original_max_position_embeddings: the pretraining context (DeepSeek-V3: 4096)
    beta_fast, beta_slow: the ramp's rotation bounds (default 32 and 1; 0 means the default)
    mscale, mscale_all_dim: DeepSeek's magnitude scales (default 1 and 0)
    attention_factor: the cos/sin scale (default: from factor, mscale and mscale_all_dim)
    truncate: floor/ceil the ramp's bounds (default true)

YaRN (Peng et al. 2023, arXiv:2309.00071) per rotary pair i of r dims, base θ:
    inv_freq_i = θ^(-2i/r) · (1 − γ_i) / s + θ^(-2i/r) · γ_i
with γ_i = 1 − clamp((i − low) / (high − low), 0, 1) from the correction range [low, high] of
beta_fast and beta_slow; cos and sin are multiplied by attention_factor = mscale(s, mscale) /
mscale(s, mscale_all_dim) (both given and non-zero) or mscale(s) (otherwise), mscale(s, m) =
0.1·m·ln s + 1 (1 for s <= 1). MLA's softmax scale is 1/sqrt(d_qk) · mscale(s, mscale_all_dim)²
when mscale_all_dim is non-zero (DeepSeek's, HF's `yarn_apply_mscale`).

Light (no torch at import): validation reads `check_rope_scaling`.
"""

from __future__ import annotations

import math
from typing import Any

KEYS = (
    "type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
)  # fmt: skip
EXAMPLE = (
    "{type: yarn, factor: 40, original_max_position_embeddings: 4096, beta_fast: 32, "
    "beta_slow: 1, mscale: 1, mscale_all_dim: 1}"
)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale 0.1·mscale·ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor on RoPE's cos and sin (1 without scaling)."""
    if not scaling:
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = (
        scaling["factor"],
        scaling.get("mscale"),
        scaling.get("mscale_all_dim"),
    )
    if mscale and all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, all_dim)
    return yarn_get_mscale(factor)


def softmax_scale_factor(scaling: dict[str, Any] | None) -> float:
    """What MLA's softmax scale is multiplied by beyond 1/sqrt(d_qk): mscale(s, mscale_all_dim)²
    when mscale_all_dim is set and non-zero, else 1."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None):
    """RoPE's inverse frequencies [r/2] (float64 torch tensor) for r = rotary_dim rotated dims:
    θ^(-2i/r), blended toward θ^(-2i/r)/factor by YaRN's ramp when `scaling` is set."""
    import torch

    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64)
    extrapolation = 1.0 / theta ** (exponents / rotary_dim)
    if not scaling:
        return extrapolation
    factor = float(scaling["factor"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dim completing `rotations` turns
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high-frequency pairs), 0: interpolate by 1/factor
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def check_rope_scaling(cfg) -> None:
    """model.rope_scaling: null, or a YaRN mapping with a factor >= 1 and the original
    context; every key known (a typo would silently mean a default)."""
    from megatron_lite.validation.rules import _rule  # loaded with validation, its caller

    rs = cfg.model.rope_scaling
    if rs is None:
        return
    key, fix = "model.rope_scaling", f"give a YaRN mapping, e.g. model.rope_scaling={EXAMPLE}"
    unknown = sorted(set(rs) - set(KEYS))
    _rule(not unknown, key, rs, f"has unknown keys {unknown} (known: {', '.join(KEYS)})", fix)
    kind = rs.get("type", rs.get("rope_type"))
    _rule(kind == "yarn", key, rs, f"type {kind!r}: only yarn scaling is supported", fix)
    for name in ("factor", "original_max_position_embeddings"):
        _rule(name in rs, key, rs, f"needs {name}", fix)
    numbers = [k for k in KEYS if k not in ("type", "rope_type", "truncate") and k in rs]
    for name in numbers:
        ok = isinstance(rs[name], int | float) and not isinstance(rs[name], bool)
        _rule(ok and rs[name] >= 0, key, rs, f"{name}={rs[name]!r} must be a number >= 0", fix)
    _rule(rs["factor"] >= 1, key, rs, f"factor={rs['factor']} must be >= 1 (an extension)", fix)
    _rule(
        rs["original_max_position_embeddings"] >= 1,
        key, rs, "original_max_position_embeddings must be >= 1", fix,
    )  # fmt: skip
    truncate = rs.get("truncate", True)
    _rule(isinstance(truncate, bool), key, rs, f"truncate={truncate!r} must be true/false", fix)
