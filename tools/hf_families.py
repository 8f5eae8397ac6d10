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
import os
import sys

import torch

# Run as a script from a checkout (`python tools/hf_families.py`): make `tools` importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from megatron_lite import resolve  # noqa: E402
from megatron_lite.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.models.registry import hf_architecture  # noqa: E402
from tools.hf_checks import (  # noqa: E402
    check_count,
    check_expert_count,
    check_hf_config,
    check_our_model,
    check_shapes,
)

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
    """Which HF family our model exports to: llama (dense), qwen3_moe (q/k norms), mixtral;
    the architecture's registry entry must name them (`hf_families`)."""
    if mc.arch != hf_architecture("llama"):  # the entry that claims this converter's families
        raise CheckpointError(
            f"model.arch={mc.arch!r}: its registry entry names none of the HF families this "
            f"converter writes ({sorted(ARCHITECTURES)}); only model.arch="
            f"{hf_architecture('llama')!r} models convert to HF"
        )
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


def _family_of_hf(c: dict, file: str) -> str:
    kind = c.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES or not hf_architecture(kind):
        archs = c.get("architectures")
        raise CheckpointError(
            f"{file}: HF model_type={kind!r} (architectures {archs}): only "
            f"{sorted(ARCHITECTURES)} (LlamaForCausalLM, MixtralForCausalLM, "
            "Qwen3MoeForCausalLM) convert. Fix: convert a model of one of these families"
        )
    return kind


def from_hf_config(c: dict, file: str = "config.json") -> dict:
    """A Llama, Mixtral or Qwen3-MoE config.json -> our model.* keys. Every field read is
    checked first (tools/hf_checks.py) and an unsupported field is an error naming it."""
    check_hf_config(c, None, file)  # a JSON object, before anything is read from it
    family = _family_of_hf(c, file)
    check_hf_config(c, family, file)
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
        raise CheckpointError(
            f"{file}: this HF {family} config uses what megatron_lite lacks: {bad}. Fix: "
            "convert a model without them"
        )
    out = {
        "arch": hf_architecture(family),  # the registry entry that names this family
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


def _one_to_one_shapes(mc: ModelConfig, vocab: int) -> dict[str, tuple[int, ...]]:
    """Shapes of layer tensors by the suffix of their name (ours), from the config."""
    h, d = mc.hidden_size, resolve.kv_channels(mc)
    q, kv = mc.num_attention_heads * d, resolve.num_query_groups(mc) * d
    f = resolve.ffn_hidden_size(mc)
    return {
        "embedding.weight": (vocab, h),
        "final_norm.weight": (h,),
        "output_layer.weight": (vocab, h),
        "input_norm.weight": (h,),
        "self_attention.linear_qkv.weight/q": (q, h),
        "self_attention.linear_qkv.weight/k": (kv, h),
        "self_attention.linear_qkv.weight/v": (kv, h),
        "self_attention.linear_proj.weight": (h, q),
        "pre_mlp_norm.weight": (h,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "mlp.linear_fc1.weight/gate": (f, h),
        "mlp.linear_fc1.weight/up": (f, h),
        "mlp.linear_fc2.weight": (h, f),
        "mlp.router.weight": (mc.num_experts or 0, h),
    }


def our_shapes(mc: ModelConfig, family: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's full shape by our logical name, as config `mc` and `vocab` give it (the
    experts stacked: weight1 [E, 2·ffn, h], weight2 [E, h, ffn])."""
    by_suffix = _one_to_one_shapes(mc, vocab)
    ours = {
        k: by_suffix[k.split(".", 2)[-1] if k.startswith("layers.") else k]
        for k in name_map(mc, family)
    }
    h, f, e = mc.hidden_size, resolve.moe_ffn_hidden_size(mc), mc.num_experts
    for i in range(mc.num_layers):
        if resolve.is_moe_layer(mc, i):
            ours[f"layers.{i}.mlp.experts.weight1"] = (e, 2 * f, h)
            ours[f"layers.{i}.mlp.experts.weight2"] = (e, h, f)
    return ours


def hf_shapes(mc: ModelConfig, family: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """The same by HF name (one matrix per expert)."""
    names = name_map(mc, family)
    ours = our_shapes(mc, family, vocab)
    out = {names[k]: s for k, s in ours.items() if k in names}
    h, f = mc.hidden_size, resolve.moe_ffn_hidden_size(mc)
    for i in range(mc.num_layers):
        if resolve.is_moe_layer(mc, i):
            gate, up, down = _expert_names(mc, family, i)
            out |= {n: (f, h) for n in gate + up} | {n: (h, f) for n in down}
    return out


def _dtypes(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()}


def to_hf_tensors(m: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full logical tensors -> HF's, named for the model's family (the experts unstacked)."""
    mc = full_model_config(m)
    check_our_model(mc, "the checkpoint's metadata.json")
    family = family_of(mc)
    check_count(tensors, mc.num_layers, "the checkpoint", "model.num_layers")
    names = name_map(mc, family)
    moe_layers = [i for i in range(mc.num_layers) if resolve.is_moe_layer(mc, i)]
    stacked = {f"layers.{i}.mlp.experts.weight{j}" for i in moe_layers for j in (1, 2)}
    _check_names(set(names) | stacked, set(tensors), "the checkpoint")
    vocab = tensors["embedding.weight"].shape[0]
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    check_shapes(shapes, our_shapes(mc, family, vocab), _dtypes(tensors), "the checkpoint")
    out = {names[k]: t for k, t in tensors.items() if k in names}
    f = resolve.moe_ffn_hidden_size(mc) if moe_layers else 0
    for i in moe_layers:
        w1 = tensors[f"layers.{i}.mlp.experts.weight1"]  # [E, 2·ffn, h]: [gate; up]
        w2 = tensors[f"layers.{i}.mlp.experts.weight2"]  # [E, h, ffn]
        gate, up, down = _expert_names(mc, family, i)
        for e in range(mc.num_experts):  # clones: safetensors refuses views of one storage
            out[gate[e]], out[up[e]] = w1[e, :f].clone(), w1[e, f:].clone()
            out[down[e]] = w2[e].clone()
    return out


def from_hf_tensors(m: dict, hf: dict[str, torch.Tensor], where=lambda name: "") -> dict:
    """HF tensors of the family that config `m` came from -> our logical tensors (experts
    stacked). Raises CheckpointError naming missing or unexpected tensors, or one whose shape
    or dtype the config does not give (`where(name)`: the file it came from)."""
    mc = full_model_config(m)
    family = family_of(mc)
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if mc.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some exporters write the tied copy
    check_count(hf, mc.num_layers, "the HF weights", "num_hidden_layers")
    if mc.num_experts is not None:
        key = "num_local_experts" if family == "mixtral" else "num_experts"
        check_expert_count(hf, mc.num_experts, "the HF weights", key)
    want = hf_shapes(mc, family, m["vocab_size"])
    _check_names(set(want), set(hf), "the HF weights")
    shapes = {k: tuple(t.shape) for k, t in hf.items()}
    check_shapes(shapes, want, _dtypes(hf), "the HF weights", where)
    back = {v: k for k, v in name_map(mc, family).items()}
    stacked = {}
    for i in range(mc.num_layers):
        if resolve.is_moe_layer(mc, i):
            stacked[i] = _expert_names(mc, family, i)
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
            f"({len(missing)} missing, {len(extra)} unexpected). Fix: convert a complete "
            "model whose config.json belongs to its weights"
        )
