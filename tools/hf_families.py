"""The Hugging Face model families tools/convert_checkpoint.py converts: their config.json keys
and tensor names against ours, for LlamaForCausalLM (dense), MixtralForCausalLM and
Qwen3MoeForCausalLM (mixture of experts).

Our checkpoints store fused tensors per segment (q/k/v, gate/up) except the stacked experts:
`mlp.experts.weight1` [E, 2·ffn, h] ([gate; up] per expert) and `mlp.experts.weight2`
[E, h, ffn], which HF stores one matrix per expert (Mixtral w1 = gate, w3 = up, w2 = down;
Qwen3-MoE gate_proj, up_proj, down_proj). The routers agree as configured here: softmax over
all experts, top-k, renormalized when model.moe_router_norm_topk (Mixtral always; Qwen3-MoE's
norm_topk_prob), computed in fp32.

The aux-loss coefficient: HF's load-balancing loss is E·Σ_e f_e·P_e with f_e the fraction of
tokens that chose expert e (summed over the k choices, so uniform routing gives k), ours divides
the same product by k (uniform gives 1), so moe_aux_loss_coeff = router_aux_loss_coef · k gives
the same gradient (HF applies it only with output_router_logits; ours whenever it is non-zero).
Training-only settings with no HF field (z-loss, capacity factor, dropout) are not exported.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_lite import resolve
from megatron_lite.checkpoint.errors import CheckpointError
from megatron_lite.config import ModelConfig

ATTENTION = {  # ours (under layers.<i>.) -> HF (under model.layers.<i>.)
    "input_norm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight/q": "self_attn.q_proj.weight",
    "self_attention.linear_qkv.weight/k": "self_attn.k_proj.weight",
    "self_attention.linear_qkv.weight/v": "self_attn.v_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_norm.weight": "post_attention_layernorm.weight",
}
QK_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
DENSE_MLP = {
    "mlp.linear_fc1.weight/gate": "mlp.gate_proj.weight",
    "mlp.linear_fc1.weight/up": "mlp.up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# family: (router, per-expert (gate, up, down) with {e} for the expert index), under the layer
MOE = {
    "mixtral": (
        "block_sparse_moe.gate.weight",
        tuple(f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")),
    ),
    "qwen3_moe": (
        "mlp.gate.weight",
        tuple(f"mlp.experts.{{e}}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")),
    ),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def full_model_config(m: dict) -> ModelConfig:
    """A checkpoint's model config (model-only checkpoints hold a subset) over the defaults."""
    return ModelConfig(**{**dataclasses.asdict(ModelConfig()), **m})


def family_of(mc: ModelConfig) -> str:
    """Which HF family our model exports to: llama (dense), qwen3_moe (q/k norms), mixtral."""
    if mc.arch != "llama":
        raise CheckpointError(f"model.arch={mc.arch!r}: only llama-style models convert to HF")
    if mc.num_experts is None:
        if mc.qk_layernorm:
            raise CheckpointError(
                "model.qk_layernorm=true on a dense model (Qwen3): only MoE models with q/k "
                "norms convert (to Qwen3-MoE); dense ones need model.qk_layernorm=false"
            )
        return "llama"
    unsupported = {
        "moe_router_score_function": mc.moe_router_score_function != "softmax",
        "moe_router_enable_expert_bias": mc.moe_router_enable_expert_bias,
        "moe_router_num_groups": mc.moe_router_num_groups not in (None, 1),
        "moe_router_topk_scaling_factor": mc.moe_router_topk_scaling_factor not in (None, 1.0),
        "moe_shared_expert_ffn_hidden_size": mc.moe_shared_expert_ffn_hidden_size > 0,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(
            f"model.{bad}: Mixtral and Qwen3-MoE route by softmax top-k with no expert bias, "
            "groups, scaling or shared experts; this model has no HF equivalent here"
        )
    if mc.qk_layernorm:
        return "qwen3_moe"
    if not mc.moe_router_norm_topk or not all(resolve.moe_layer_pattern(mc)):
        raise CheckpointError(
            f"model.moe_router_norm_topk={mc.moe_router_norm_topk}, moe_layer_freq="
            f"{mc.moe_layer_freq}: without q/k norms the model exports to Mixtral, whose "
            "every layer is MoE with renormalized top-k weights; set moe_router_norm_topk=true "
            "and moe_layer_freq=1 (or model.qk_layernorm=true for Qwen3-MoE)"
        )
    return "mixtral"


# ------------------------------------------------------------------ configs
def to_hf_config(m: dict, vocab_size: int) -> dict:
    """Our model config (dict of ModelConfig) -> the config.json of its HF family."""
    mc = full_model_config(m)
    family = family_of(mc)
    d = resolve.kv_channels(mc)
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": mc.hidden_size,
        "intermediate_size": resolve.ffn_hidden_size(mc),
        "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": resolve.num_query_groups(mc),
        "head_dim": d,
        "max_position_embeddings": resolve.max_position_embeddings(mc),
        "rms_norm_eps": mc.norm_eps,
        "rope_theta": mc.rope_theta,
        "tie_word_embeddings": mc.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": mc.init_method_std,
        "torch_dtype": "float32",
    }
    if family == "llama":
        return out | {"attention_bias": False, "mlp_bias": False}
    k = mc.moe_router_topk
    moe = {
        "num_experts_per_tok": k,
        "router_aux_loss_coef": mc.moe_aux_loss_coeff / k,  # module docstring
        "output_router_logits": False,
        "sliding_window": None,
    }
    if family == "mixtral":
        moe_f = resolve.moe_ffn_hidden_size(mc)
        return out | moe | {"intermediate_size": moe_f, "num_local_experts": mc.num_experts}
    pattern = resolve.moe_layer_pattern(mc)
    return (
        out
        | moe
        | {
            "moe_intermediate_size": resolve.moe_ffn_hidden_size(mc),
            "num_experts": mc.num_experts,
            "norm_topk_prob": bool(mc.moe_router_norm_topk),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, is_moe in enumerate(pattern) if not is_moe],
            "attention_bias": False,
            "use_sliding_window": False,
        }
    )


def _family_of_hf(c: dict) -> str:
    kind = c.get("model_type")
    if kind not in ARCHITECTURES:
        archs = c.get("architectures")
        raise CheckpointError(
            f"HF model_type={kind!r} (architectures {archs}): only {sorted(ARCHITECTURES)} "
            "(LlamaForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM) convert"
        )
    return kind


def from_hf_config(c: dict) -> dict:
    """A Llama, Mixtral or Qwen3-MoE config.json -> our model.* keys (checked for what we
    implement: an unsupported field is an error naming it)."""
    family = _family_of_hf(c)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    unsupported = {
        "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
        "attention_bias": c.get("attention_bias", False),
        "mlp_bias": c.get("mlp_bias", False),
        f"hidden_act {c.get('hidden_act')}": c.get("hidden_act", "silu") != "silu",
    }
    if family == "mixtral":  # Mixtral's sliding window is on whenever set
        unsupported["sliding_window"] = c.get("sliding_window") is not None
        unsupported["router_jitter_noise"] = bool(c.get("router_jitter_noise", 0.0))
    if family == "qwen3_moe":
        unsupported["use_sliding_window"] = c.get("use_sliding_window", False)
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(f"this HF {family} config uses what megatron_lite lacks: {bad}")
    out = {
        "arch": "llama",
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": c.get("num_key_value_heads") or heads,
        "kv_channels": None if head_dim * heads == c["hidden_size"] else head_dim,
        "ffn_hidden_size": c["intermediate_size"],
        "vocab_size": c["vocab_size"],
        "max_position_embeddings": c.get("max_position_embeddings"),
        "tie_embeddings": c.get("tie_word_embeddings", False),
        "norm_eps": c.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
    }
    if family == "llama":
        return out
    k = c.get("num_experts_per_tok", 2)
    out |= {
        "moe_router_topk": k,
        "moe_aux_loss_coeff": c.get("router_aux_loss_coef", 0.0) * k,  # module docstring
    }
    if family == "mixtral":
        return out | {
            "num_experts": c.get("num_local_experts", 8),
            "moe_ffn_hidden_size": c["intermediate_size"],
            "moe_router_norm_topk": True,
        }
    dense, step = set(c.get("mlp_only_layers") or []), c.get("decoder_sparse_step", 1)
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(out["num_layers"])]
    return out | {
        "num_experts": c.get("num_experts", c.get("num_local_experts")),
        "moe_ffn_hidden_size": c["moe_intermediate_size"],
        "moe_router_norm_topk": bool(c.get("norm_topk_prob", False)),
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "qk_layernorm": True,
    }


# ------------------------------------------------------------------ tensors
def _layer_names(mc: ModelConfig, family: str, i: int) -> dict[str, str]:
    """Ours -> HF for layer i's tensors that map one to one (not the stacked experts)."""
    names = dict(ATTENTION)
    if mc.qk_layernorm:
        names |= QK_NORMS
    if resolve.is_moe_layer(mc, i):
        names["mlp.router.weight"] = MOE[family][0]
    else:
        names |= DENSE_MLP
    return {f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in names.items()}


def name_map(mc: ModelConfig, family: str) -> dict[str, str]:
    """Our logical tensor names -> HF names, for the tensors that map one to one."""
    out = {
        "embedding.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
    }
    if not mc.tie_embeddings:
        out["output_layer.weight"] = "lm_head.weight"
    for i in range(mc.num_layers):
        out |= _layer_names(mc, family, i)
    return out


def _expert_names(mc: ModelConfig, family: str, i: int) -> tuple[list[str], ...]:
    """HF (gate, up, down) names of each of layer i's experts: three lists of E names."""
    per_expert = MOE[family][1]
    prefix = f"model.layers.{i}."
    return tuple([prefix + w.format(e=e) for e in range(mc.num_experts)] for w in per_expert)


def to_hf_tensors(m: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full logical tensors -> HF's, named for the model's family (the experts unstacked)."""
    mc = full_model_config(m)
    family = family_of(mc)
    names = name_map(mc, family)
    moe_layers = [i for i in range(mc.num_layers) if resolve.is_moe_layer(mc, i)]
    stacked = {f"layers.{i}.mlp.experts.weight{j}" for i in moe_layers for j in (1, 2)}
    _check_names(set(names) | stacked, set(tensors), "the checkpoint")
    out = {names[k]: t for k, t in tensors.items() if k in names}
    f = resolve.moe_ffn_hidden_size(mc) if moe_layers else 0
    for i in moe_layers:
        w1 = tensors[f"layers.{i}.mlp.experts.weight1"]  # [E, 2·ffn, h]: [gate; up]
        w2 = tensors[f"layers.{i}.mlp.experts.weight2"]  # [E, h, ffn]
        if w1.shape[1] != 2 * f:
            raise CheckpointError(
                f"layer {i} experts weight1 {tuple(w1.shape)}: want 2·ffn={2 * f}"
            )
        gate, up, down = _expert_names(mc, family, i)
        for e in range(mc.num_experts):  # clones: safetensors refuses views of one storage
            out[gate[e]], out[up[e]] = w1[e, :f].clone(), w1[e, f:].clone()
            out[down[e]] = w2[e].clone()
    return out


def from_hf_tensors(m: dict, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors of the family that config `m` came from -> our logical tensors (experts
    stacked). Raises CheckpointError naming missing or unexpected tensors."""
    mc = full_model_config(m)
    family = family_of(mc)
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if mc.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some exporters write the tied copy
    back = {v: k for k, v in name_map(mc, family).items()}
    stacked = {}
    for i in range(mc.num_layers):
        if resolve.is_moe_layer(mc, i):
            stacked[i] = _expert_names(mc, family, i)
    expected = set(back) | {n for lists in stacked.values() for names in lists for n in names}
    _check_names(expected, set(hf), "the HF weights")
    out = {back[k]: t for k, t in hf.items() if k in back}
    for i, (gate, up, down) in stacked.items():
        gates, ups = torch.stack([hf[n] for n in gate]), torch.stack([hf[n] for n in up])
        out[f"layers.{i}.mlp.experts.weight1"] = torch.cat([gates, ups], dim=1)  # [E, 2f, h]
        out[f"layers.{i}.mlp.experts.weight2"] = torch.stack([hf[n] for n in down])  # [E, h, f]
    return out


def _check_names(expected: set[str], present: set[str], what: str) -> None:
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing or extra:
        raise CheckpointError(
            f"{what}: tensors missing {missing[:4]}, unexpected {extra[:4]} "
            f"({len(missing)} missing, {len(extra)} unexpected)"
        )
