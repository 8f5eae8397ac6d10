"""The Hugging Face model families tools/convert_checkpoint.py converts, and their config.json
keys against ours: LlamaForCausalLM and Qwen3ForCausalLM (dense), MixtralForCausalLM,
Qwen3MoeForCausalLM and Qwen2MoeForCausalLM (mixture of experts), and DeepseekV3ForCausalLM
(MLA, DeepSeek's routing, MTP: tools/hf_deepseek.py). Their tensors: tools/hf_tensors.py
(to_hf_tensors and from_hf_tensors are re-exported here).

Which family a model of ours exports to (`family_of`): with multi-head latent attention
(model.multi_latent_attention) DeepSeek-V3; dense with q/k norms (model.qk_layernorm)
is Qwen3, dense without is Llama; MoE with a gated shared expert (moe_shared_expert_ffn_hidden_size
and moe_shared_expert_gate, q/k/v biases per model.add_qkv_bias) is Qwen2-MoE, MoE with q/k
norms is Qwen3-MoE, the rest Mixtral. The routers agree as configured here: softmax over all
experts, top-k, renormalized when model.moe_router_norm_topk (Mixtral always; Qwen2/3-MoE's
norm_topk_prob), computed in fp32.

A field missing from a config.json takes the default of its transformers config class
(HF_DEFAULTS, checked against transformers by the tests), as transformers itself would load it.

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

# Run as a script from a checkout (`python tools/hf_families.py`): make `tools` importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from megatron_lite import resolve  # noqa: E402
from megatron_lite.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.models.registry import hf_architecture  # noqa: E402
from tools import hf_deepseek  # noqa: E402
from tools.hf_checks import HF_DEFAULTS, check_hf_config  # noqa: E402
from tools.hf_tensors import from_hf_tensors, to_hf_tensors  # noqa: E402

__all__ = [
    "ARCHITECTURES", "HF_DEFAULTS", "family_of", "from_hf_config", "from_hf_tensors",
    "full_model_config", "to_hf_config", "to_hf_tensors",
]  # fmt: skip

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": hf_deepseek.ARCHITECTURE,
}


def full_model_config(m: dict) -> ModelConfig:
    """A checkpoint's model config (model-only checkpoints hold a subset) over the defaults."""
    return ModelConfig(**{**dataclasses.asdict(ModelConfig()), **m})


def _refuse(what: str, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{what}: {rule}; this model has no HF equivalent here. Fix: {fix}")


def _dense_family(mc: ModelConfig) -> str:
    if mc.add_qkv_bias:
        raise _refuse(
            "model.add_qkv_bias=true on a dense model",
            "the dense families converted here (Llama, Qwen3) have no q/k/v biases",
            "export a model with model.add_qkv_bias=false",
        )
    return "qwen3" if mc.qk_layernorm else "llama"


def family_of(mc: ModelConfig) -> str:
    """Which HF family our model exports to (module docstring); the architecture's registry
    entry must name them (`hf_families`)."""
    if mc.arch != hf_architecture("llama"):  # the entry that claims this converter's families
        raise CheckpointError(
            f"model.arch={mc.arch!r}: its registry entry names none of the HF families this "
            f"converter writes ({sorted(ARCHITECTURES)}); only model.arch="
            f"{hf_architecture('llama')!r} models convert to HF"
        )
    if mc.multi_latent_attention:
        hf_deepseek.check_exportable(mc)
        return "deepseek_v3"
    if mc.rope_scaling:
        raise _refuse(
            f"model.rope_scaling={mc.rope_scaling} without multi-latent attention",
            "Llama, Qwen3, Mixtral and Qwen2/3-MoE are converted without rope scaling",
            "export a model with model.rope_scaling=null",
        )
    if mc.num_experts is None:
        return _dense_family(mc)
    unsupported = {
        "moe_router_score_function": mc.moe_router_score_function != "softmax",
        "moe_router_enable_expert_bias": mc.moe_router_enable_expert_bias,
        "moe_router_num_groups": mc.moe_router_num_groups not in (None, 1),
        "moe_router_topk_scaling_factor": mc.moe_router_topk_scaling_factor not in (None, 1.0),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise _refuse(
            f"model.{bad}",
            "Mixtral and Qwen2/3-MoE route by softmax top-k with no expert bias, groups or scaling",
            "export a softmax top-k router",
        )
    if mc.moe_shared_expert_ffn_hidden_size > 0:
        if not mc.moe_shared_expert_gate or mc.qk_layernorm:
            raise _refuse(
                f"model.moe_shared_expert_ffn_hidden_size={mc.moe_shared_expert_ffn_hidden_size}"
                f" with moe_shared_expert_gate={mc.moe_shared_expert_gate}, qk_layernorm="
                f"{mc.qk_layernorm}",
                "the one family with a shared expert here, Qwen2-MoE, gates it by a sigmoid and "
                "has no q/k norms",
                "set model.moe_shared_expert_gate=true and qk_layernorm=false (Qwen2-MoE)",
            )
        return "qwen2_moe"
    if mc.add_qkv_bias:
        raise _refuse(
            "model.add_qkv_bias=true on an MoE model without a shared expert",
            "Mixtral and Qwen3-MoE have no q/k/v biases (Qwen2-MoE has, with a gated shared "
            "expert)",
            "export a model with model.add_qkv_bias=false",
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


# ------------------------------------------------------------------ our config -> config.json
def to_hf_config(m: dict, vocab_size: int) -> dict:
    """Our model config (dict of ModelConfig) -> the config.json of its HF family, every field
    its transformers class reads written out (none left to a default that may not fit)."""
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
    no_window = {"use_sliding_window": False, "sliding_window": None}
    if family == "deepseek_v3":
        return hf_deepseek.to_hf_config(mc, out)
    if family == "llama":
        return out | {"attention_bias": False, "mlp_bias": False}
    if family == "qwen3":
        return out | no_window | {"attention_bias": False, "max_window_layers": mc.num_layers}
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
    qwen = out | moe | no_window
    qwen |= {
        "moe_intermediate_size": resolve.moe_ffn_hidden_size(mc),
        "num_experts": mc.num_experts,
        "norm_topk_prob": bool(mc.moe_router_norm_topk),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, is_moe in enumerate(pattern) if not is_moe],
        "max_window_layers": mc.num_layers,
    }
    if family == "qwen3_moe":
        return qwen | {"attention_bias": False}
    return qwen | {
        "shared_expert_intermediate_size": mc.moe_shared_expert_ffn_hidden_size,
        "qkv_bias": mc.add_qkv_bias,
    }


# ------------------------------------------------------------------ config.json -> our config
def _family_of_hf(c: dict, file: str) -> str:
    kind = c.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES or not hf_architecture(kind):
        archs = c.get("architectures")
        raise CheckpointError(
            f"{file}: HF model_type={kind!r} (architectures {archs}): only "
            f"{sorted(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())}) convert. Fix: "
            "convert a model of one of these families"
        )
    return kind


def _unsupported(c: dict, family: str, rope: dict) -> list[str]:
    """The fields of a config.json whose value megatron_lite cannot represent."""
    unsupported = {
        "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
        "mlp_bias": c.get("mlp_bias", False),
        f"hidden_act {c.get('hidden_act')}": c.get("hidden_act", "silu") != "silu",
    }
    if family != "qwen2_moe":  # Llama/Qwen3 put it on o_proj too; Qwen2-MoE has qkv_bias
        unsupported["attention_bias (on o_proj too)"] = c.get("attention_bias", False)
    if family == "mixtral":  # Mixtral's sliding window is on whenever set
        unsupported["sliding_window"] = c.get("sliding_window") is not None
        unsupported["router_jitter_noise"] = bool(c.get("router_jitter_noise", 0.0))
    else:  # the Qwen families: windows where use_sliding_window or layer_types say so
        unsupported["use_sliding_window"] = c.get("use_sliding_window", False)
        types = c.get("layer_types") or []
        unsupported["layer_types (sliding_attention)"] = any(t != "full_attention" for t in types)
    return [k for k, v in unsupported.items() if v]


def from_hf_config(c: dict, file: str = "config.json") -> dict:
    """A config.json of one of the families -> our model.* keys. Every field read is checked
    first (tools/hf_checks.py) and an unsupported field is an error naming it."""
    check_hf_config(c, None, file)  # a JSON object, before anything is read from it
    family = _family_of_hf(c, file)
    check_hf_config(c, family, file)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    bad = [] if family == "deepseek_v3" else _unsupported(c, family, rope)
    if bad:
        raise CheckpointError(
            f"{file}: this HF {family} config uses what megatron_lite lacks: {bad}. Fix: "
            "convert a model without them"
        )
    theta = c.get("rope_theta", rope.get("rope_theta", HF_DEFAULTS[family]["rope_theta"]))
    if family in ("qwen3_moe", "qwen2_moe") and "num_experts" not in c:
        c = {**c, "num_experts": c.get("num_local_experts")}  # HF's attribute map reads it so
    nullable = ("head_dim", "q_lora_rank")  # null means something: hidden / heads, no q lora
    c = HF_DEFAULTS[family] | {k: v for k, v in c.items() if v is not None or k in nullable}
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
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
        "tie_embeddings": c["tie_word_embeddings"],
        "norm_eps": c["rms_norm_eps"],
        "rope_theta": theta,
    }
    if family == "deepseek_v3":
        return hf_deepseek.from_hf_config(c, out, file)
    if family in ("llama", "qwen3"):
        return out | ({"qk_layernorm": True} if family == "qwen3" else {})
    k = c["num_experts_per_tok"]
    out |= {"moe_router_topk": k, "moe_aux_loss_coeff": c["router_aux_loss_coef"] * k}
    if family == "mixtral":
        return out | {
            "num_experts": c["num_local_experts"],
            "moe_ffn_hidden_size": c["intermediate_size"],
            "moe_router_norm_topk": True,
        }
    dense, step = set(c.get("mlp_only_layers") or []), c["decoder_sparse_step"]
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(out["num_layers"])]
    out |= {
        "num_experts": c["num_experts"],
        "moe_ffn_hidden_size": c["moe_intermediate_size"],
        "moe_router_norm_topk": bool(c["norm_topk_prob"]),
        "moe_layer_freq": 1 if all(pattern) else pattern,
    }
    if family == "qwen3_moe":
        return out | {"qk_layernorm": True}
    return out | {
        "moe_shared_expert_ffn_hidden_size": c["shared_expert_intermediate_size"],
        "moe_shared_expert_gate": True,
        "add_qkv_bias": bool(c["qkv_bias"]),
    }
