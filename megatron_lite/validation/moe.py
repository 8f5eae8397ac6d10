"""Mixture-of-experts rules: expert count over ep, router top-k, and MoE loss/capacity ranges."""

from __future__ import annotations

from megatron_lite.config import Config, ModelConfig
from megatron_lite.parallel.mesh import expert_problem
from megatron_lite.validation.rules import _rule


def _validate_moe(cfg: Config) -> None:
    """Experts over ep, and ep over the dp·cp ranks the experts fold into."""
    m, p = cfg.model, cfg.parallel
    if m.num_experts is not None:
        _rule(
            m.num_experts >= 1,
            "model.num_experts",
            m.num_experts,
            "must be >= 1",
            "use a positive expert count",
        )
        _rule(
            m.num_experts % p.ep == 0,
            "parallel.ep",
            p.ep,
            f"model.num_experts={m.num_experts} must be divisible by ep",
            "use an ep that divides the expert count",
        )
        _rule(
            1 <= m.moe_router_topk <= m.num_experts,
            "model.moe_router_topk",
            m.moe_router_topk,
            f"must be between 1 and num_experts={m.num_experts}",
            "lower the top-k",
        )
        _validate_moe_ranges(m)
    else:
        _rule(
            p.ep == 1,
            "parallel.ep",
            p.ep,
            "expert parallelism needs an MoE model",
            "set model.num_experts or parallel.ep=1",
        )
    problem = expert_problem(p.ep, p.dp, p.cp)
    _rule(problem is None, "parallel.ep", p.ep, str(problem), "use an ep that divides dp·cp")


def _validate_moe_ranges(m: ModelConfig) -> None:
    _rule(
        m.moe_layer_freq >= 1,
        "model.moe_layer_freq",
        m.moe_layer_freq,
        "must be >= 1 (every k-th layer is MoE)",
        "use 1 for all layers",
    )
    _rule(
        m.moe_capacity_factor is None or m.moe_capacity_factor > 0,
        "model.moe_capacity_factor",
        m.moe_capacity_factor,
        "must be > 0 when set",
        "use e.g. 1.25, or null for dropless",
    )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        _rule(
            getattr(m, key) >= 0,
            f"model.{key}",
            getattr(m, key),
            "must be >= 0",
            "use 0 to disable it",
        )
    _rule(
        m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size >= 1,
        "model.moe_ffn_hidden_size",
        m.moe_ffn_hidden_size,
        "must be >= 1 when set",
        "use a positive width or null for ffn_hidden_size",
    )
