"""Mixture-of-experts rules: expert count over ep, router top-k, MoE loss/capacity ranges, the
shared expert over tp, and the one-line warnings of MoE keys that have no effect.

The ranges of the MoE keys hold on a dense model too (an invalid value is an error whether or
not the feature is on); a valid value other than the default warns that it has no effect."""

from __future__ import annotations

import dataclasses

import torch

from megatron_lite.config import Config, ModelConfig
from megatron_lite.moe.group_score import GROUP_SCORES, group_score_width
from megatron_lite.parallel.mesh import expert_problem
from megatron_lite.resolve import num_moe_layers
from megatron_lite.validation.rules import _choice, _no_effect, _rule, _stored


def _validate_moe(cfg: Config) -> None:
    """Experts over ep, and ep over the dp·cp ranks the experts fold into."""
    m, p = cfg.model, cfg.parallel
    _validate_moe_ranges(m)
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
        _validate_groups(m)
        _validate_moe_widths(cfg)
        _rule(  # capacity keeps each expert's first tokens in sequence order across the CP
            # shards, which the ring's chunks (j and 2·ring−1−j) do not follow
            m.moe_capacity_factor is None or p.cp == 1 or p.cp_comm_type == "a2a",
            "model.moe_capacity_factor",
            m.moe_capacity_factor,
            f"token dropping follows the sequence order of the CP shards, which "
            f"parallel.cp_comm_type={p.cp_comm_type} (the ring's balanced chunks) does not keep",
            "use dropless MoE (model.moe_capacity_factor=null) or parallel.cp_comm_type=a2a",
        )
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
    """The MoE keys' own ranges (dense models too); the floats the router keeps as fp32 tensor
    state or fp32 math checked in fp32."""
    _rule(
        m.moe_router_topk >= 1,
        "model.moe_router_topk",
        m.moe_router_topk,
        "must be >= 1",
        "use e.g. 2",
    )
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        _rule(
            len(freq) == m.num_layers and all(v in (0, 1) for v in freq),
            "model.moe_layer_freq",
            freq,
            f"a list must give 0 (dense) or 1 (MoE) for each of the {m.num_layers} layers",
            f"list {m.num_layers} values of 0/1, or give an integer (every k-th layer is MoE)",
        )
    else:
        _rule(
            freq >= 1,
            "model.moe_layer_freq",
            freq,
            "must be >= 1 (every k-th layer is MoE) or a 0/1 list per layer",
            "use 1 for all layers",
        )
    _rule(
        0 <= m.moe_first_k_dense_replace <= m.num_layers,
        "model.moe_first_k_dense_replace",
        m.moe_first_k_dense_replace,
        f"must be between 0 and num_layers={m.num_layers}",
        "use 0 for no leading dense layers (DeepSeek-V3 uses 3)",
    )
    _choice("model.moe_router_score_function", m.moe_router_score_function, ("softmax", "sigmoid"))
    _choice("model.moe_aux_loss_type", m.moe_aux_loss_type, ("global", "seq"))
    _choice("model.moe_router_group_score", m.moe_router_group_score, GROUP_SCORES)
    _rule(
        m.moe_router_topk_scaling_factor is None or m.moe_router_topk_scaling_factor > 0,
        "model.moe_router_topk_scaling_factor",
        m.moe_router_topk_scaling_factor,
        "must be > 0 when set",
        "use e.g. 2.5 (DeepSeek-V3) or null for 1",
    )
    _rule(
        m.moe_router_bias_update_rate >= 0,
        "model.moe_router_bias_update_rate",
        m.moe_router_bias_update_rate,
        "must be >= 0",
        "use e.g. 1e-3 (DeepSeek-V3)",
    )
    _rule(
        m.moe_shared_expert_ffn_hidden_size >= 0,
        "model.moe_shared_expert_ffn_hidden_size",
        m.moe_shared_expert_ffn_hidden_size,
        "must be >= 0",
        "use 0 for no shared expert",
    )
    _rule(
        not m.moe_shared_expert_overlap or m.moe_shared_expert_ffn_hidden_size > 0,
        "model.moe_shared_expert_overlap",
        m.moe_shared_expert_overlap,
        "needs a shared expert to overlap",
        "set model.moe_shared_expert_ffn_hidden_size or moe_shared_expert_overlap=false",
    )
    _rule(
        not m.moe_shared_expert_gate or m.moe_shared_expert_ffn_hidden_size > 0,
        "model.moe_shared_expert_gate",
        m.moe_shared_expert_gate,
        "gates the shared expert's output, and there is no shared expert",
        "set model.moe_shared_expert_ffn_hidden_size or moe_shared_expert_gate=false",
    )
    _rule(
        (m.moe_router_num_groups is None) == (m.moe_router_group_topk is None),
        "model.moe_router_group_topk"
        if m.moe_router_num_groups is not None
        else "model.moe_router_num_groups",
        m.moe_router_group_topk if m.moe_router_num_groups is not None else m.moe_router_num_groups,
        "group-limited routing needs both moe_router_num_groups and moe_router_group_topk",
        "set both (e.g. num_groups=8, group_topk=4) or neither",
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
    _validate_moe_dtypes(m)


# the MoE floats that become fp32 tensor state or fp32 router math: (key, where, fix)
_FP32_KEYS = (
    ("moe_router_bias_update_rate", "the expert bias it is added to", "use e.g. 1e-3"),
    ("moe_router_topk_scaling_factor", "the router's combine weights", "use e.g. 2.5 or null"),
    ("moe_aux_loss_coeff", "the router's aux-loss objective", "use e.g. 1e-2, or 0 for none"),
    ("moe_z_loss_coeff", "the router's z-loss objective", "use e.g. 1e-3, or 0 for none"),
)


def _validate_moe_dtypes(m: ModelConfig) -> None:
    for key, where, fix in _FP32_KEYS:
        _stored(f"model.{key}", getattr(m, key), torch.float32, where, fix)


def _validate_moe_widths(cfg: Config) -> None:
    """What the MoE layer's parts divide at build time: the shared expert (a dense SwiGLU on
    the TP layout) over tp, and a capacity whose product with the tokens stays finite."""
    m, p = cfg.model, cfg.parallel
    shared = m.moe_shared_expert_ffn_hidden_size
    _rule(
        shared % p.tp == 0,
        "model.moe_shared_expert_ffn_hidden_size",
        shared,
        f"must be divisible by parallel.tp={p.tp} (the shared expert's MLP is split over TP "
        "like the dense one)",
        f"use a multiple of {p.tp}, e.g. {max(p.tp, shared - shared % p.tp)}",
    )
    E, k = m.num_experts, m.moe_router_topk
    _rule(  # ceil(f·T·k/E) must stay a finite integer; from f = E/k on nothing is ever dropped
        m.moe_capacity_factor is None or m.moe_capacity_factor <= E,
        "model.moe_capacity_factor",
        m.moe_capacity_factor,
        f"must be <= model.num_experts={E} (from num_experts/topk = {E / k:g} on no token is "
        "ever dropped)",
        "use e.g. 1.25, or null for dropless",
    )


def _validate_groups(m: ModelConfig) -> None:
    """Group-limited routing: groups divide the experts, each token picks group_topk groups
    and its top-k experts inside them (the group score sums a group's top topk/group_topk, or
    its top 2: model.moe_router_group_score), so a group must hold that many experts."""
    groups, top = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None:
        return
    E, k = m.num_experts, m.moe_router_topk
    _rule(
        groups >= 1 and E % groups == 0,
        "model.moe_router_num_groups",
        groups,
        f"must divide model.num_experts={E}",
        "use a divisor of the expert count, e.g. the number of nodes of the EP group",
    )
    _rule(
        1 <= top <= groups and top <= k and k <= top * (E // groups),
        "model.moe_router_group_topk",
        top,
        f"must be in [1, num_groups={groups}], at most moe_router_topk={k}, and its groups "
        f"must hold k experts ({E // groups} per group)",
        "pick group_topk with group_topk <= topk <= group_topk·experts per group",
    )
    width = group_score_width(m.moe_router_group_score, k, top)
    _rule(
        width <= E // groups,
        "model.moe_router_group_score",
        m.moe_router_group_score,
        f"scores a group by the sum of its top {width} experts, but each of the {groups} "
        f"groups holds {E // groups}",
        "use fewer groups (at least that many experts in each), or the other group score",
    )


def moe_warnings(m: ModelConfig) -> list[str]:
    """One line per MoE key that is valid but has no effect: any MoE key other than its
    default on a dense model, the bias update rate without the expert bias, experts where no
    layer is MoE."""
    defaults = ModelConfig()
    changed = [
        f.name
        for f in dataclasses.fields(m)
        if f.name.startswith("moe_") and getattr(m, f.name) != getattr(defaults, f.name)
    ]
    if m.num_experts is None:
        why = "model.num_experts is null (a dense model)"
        fix = "set model.num_experts for an MoE model, or remove the key"
        return [_no_effect(f"model.{k}", getattr(m, k), why, fix) for k in changed]
    out = []
    if "moe_router_bias_update_rate" in changed and not m.moe_router_enable_expert_bias:
        out.append(
            _no_effect(
                "model.moe_router_bias_update_rate",
                m.moe_router_bias_update_rate,
                "model.moe_router_enable_expert_bias is false (no expert bias to update)",
                "set model.moe_router_enable_expert_bias=true, or remove the key",
            )
        )
    if "moe_router_group_score" in changed and m.moe_router_num_groups is None:
        out.append(
            _no_effect(
                "model.moe_router_group_score",
                m.moe_router_group_score,
                "model.moe_router_num_groups is null (no group-limited routing)",
                "set moe_router_num_groups and moe_router_group_topk, or remove the key",
            )
        )
    if num_moe_layers(m) == 0:
        out.append(
            _no_effect(
                "model.num_experts",
                m.num_experts,
                f"no layer is MoE (moe_layer_freq={m.moe_layer_freq}, "
                f"moe_first_k_dense_replace={m.moe_first_k_dense_replace})",
                "lower model.moe_first_k_dense_replace or set model.num_experts=null",
            )
        )
    return out
