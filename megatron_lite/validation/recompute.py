"""Activation recomputation rules (model.recompute_*), Megatron's names and semantics."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.resolve import stage_layers
from megatron_lite.validation.rules import _choice, _rule

# Megatron-Core's recompute_modules names that map onto our layers
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe")


def _validate_recompute(cfg: Config) -> None:
    """Granularity, the selective module list, and the full method and layer count."""
    m = cfg.model
    _choice("model.recompute_granularity", m.recompute_granularity, (None, "selective", "full"))
    recomputes_gemms = m.recompute_granularity == "full" or (
        m.recompute_granularity == "selective" and {"mlp", "moe"} & set(m.recompute_modules)
    )
    _rule(
        not (recomputes_gemms and m.fp8 is not None and m.linear_backend == "te"),
        "model.recompute_granularity",
        m.recompute_granularity,
        f"recomputing GEMMs under model.fp8={m.fp8!r} is not supported (the recompute runs "
        f"outside TE's fp8_autocast, so it would not repeat the forward)",
        "recompute only core_attn (recompute_granularity=selective, recompute_modules="
        "[core_attn]), or use local FP8 (model.linear_backend=local, model.fp8=tensorwise)",
    )
    if m.recompute_granularity == "selective":
        _validate_modules(cfg)
    if m.recompute_granularity != "full":
        for key in ("recompute_method", "recompute_num_layers"):
            _rule(
                getattr(m, key) is None,
                f"model.{key}",
                getattr(m, key),
                "is only used with model.recompute_granularity=full",
                f"set model.recompute_granularity=full, or model.{key}=null",
            )
        return
    _rule(
        m.recompute_method is not None,
        "model.recompute_method",
        None,
        "model.recompute_granularity=full needs a method",
        "set model.recompute_method=uniform (groups of recompute_num_layers layers) or block "
        "(the first recompute_num_layers layers of each pipeline stage)",
    )
    _choice("model.recompute_method", m.recompute_method, ("uniform", "block"))
    most = max(stage_layers(m, cfg.parallel))
    n = m.recompute_num_layers
    _rule(
        n is not None and 1 <= n <= most,
        "model.recompute_num_layers",
        n,
        f"model.recompute_granularity=full needs 1 <= recompute_num_layers <= {most} (the "
        f"layers of the largest pipeline stage)",
        f"set model.recompute_num_layers to 1 .. {most}",
    )


def _validate_modules(cfg: Config) -> None:
    m = cfg.model
    mods = m.recompute_modules
    _rule(
        len(mods) > 0,
        "model.recompute_modules",
        mods,
        "selective recompute needs at least one module",
        f"list some of {', '.join(RECOMPUTE_MODULES)} (e.g. [core_attn])",
    )
    for name in mods:
        _rule(
            name in RECOMPUTE_MODULES,
            "model.recompute_modules",
            mods,
            f"{name!r} is not a module we can recompute (one of {', '.join(RECOMPUTE_MODULES)})",
            "remove it, or use full recompute (model.recompute_granularity=full)",
        )
    _rule(
        len(set(mods)) == len(mods),
        "model.recompute_modules",
        mods,
        "lists a module twice",
        "list each module once",
    )
    _rule(
        "moe" not in mods or m.num_experts is not None,
        "model.recompute_modules",
        mods,
        "'moe' recomputes the MoE layers, but model.num_experts is null (a dense model)",
        "remove 'moe' (use 'mlp' for the dense MLP), or set model.num_experts",
    )
