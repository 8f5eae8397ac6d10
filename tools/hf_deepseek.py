"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3; Kimi K2 shares it)
against our llama entry with multi-head latent attention, DeepSeek's MoE routing and multi-token
prediction: the config both ways, the MTP layer N and the FP8 weights of the published files.
tools/hf_families.py dispatches here; the tensors' names are in tools/hf_tensors.py.

Decisions (docs/checkpoints.md, the DeepSeek-V3 family):
- Head widths: HF's qk_nope_head_dim -> model.qk_head_dim (the no-RoPE part, Megatron's
  meaning), qk_rope_head_dim -> model.qk_pos_emb_head_dim; HF's qk_head_dim is their sum.
- RoPE is interleaved (HF's rope_interleave, default true); rope_interleave=false is refused.
  YaRN rope_parameters / rope_scaling map to model.rope_scaling (its keys as HF reads them).
- Routing: sigmoid scores, the top-k of scores + e_score_correction_bias (our expert bias, which
  keeps updating at model.moe_router_bias_update_rate after conversion) within the topk_group of
  n_group groups scored by their top-2 (model.moe_router_group_score=top2), norm_topk_prob,
  routed_scaling_factor. n_group = 1 is no group limit. The published config's topk_method
  must be noaux_tc and scoring_func sigmoid (what transformers computes).
- Aux loss: transformers computes none. The published config's aux_loss_alpha (with seq_aux)
  is DeepSeek-V3's sequence-wise balance loss, eqs. 17-20, which is ours with
  moe_aux_loss_type=seq (E/k · Σ f·P, P of the normalized sigmoid scores): mapped one to one;
  absent, 0.
- Shared experts: n_shared_experts × moe_intermediate_size -> moe_shared_expert_ffn_hidden_size
  (no gate); first_k_dense_replace -> moe_first_k_dense_replace.
- MTP: the weights' layer N (num_hidden_layers) is module 1 of our MTP (model.mtp_num_layers=1)
  when num_nextn_predict_layers is 1 and the weights hold it; `--no-mtp` drops it, and so does a
  model saved by transformers (whose from_pretrained drops layer 61), each with a message.
  num_nextn_predict_layers > 1 is refused (no published model has more than one; --no-mtp
  drops them). Export writes our module 1 back as layer N, with its embed_tokens and
  shared_head.head copies.
- FP8: the published files store the matrices as float8_e4m3fn with a float32 weight_scale_inv
  per 128×128 block (quantization_config.weight_block_size); they are dequantized on import
  (w = fp8 · scale, block-wise, in float32: DeepSeek's fp8_cast_bf16.py without its bf16 cast).
"""

from __future__ import annotations

import math
import os
import sys

import torch

# Run as a script from a checkout (`python tools/hf_deepseek.py`): make `tools` importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from megatron_lite import resolve  # noqa: E402
from megatron_lite.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.models import rope_scaling  # noqa: E402
from tools.hf_checks import HF_DEFAULTS, ORIGINAL, bad  # noqa: E402

ARCHITECTURE = "DeepseekV3ForCausalLM"
# the published config's fields transformers' class lacks, as DeepSeek's code reads them absent
EXTRA_DEFAULTS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "aux_loss_alpha": 0.0}
EXTRA_DEFAULTS |= {"seq_aux": True, "moe_layer_freq": 1}
SCALE_SUFFIX = ".weight_scale_inv"


def _refuse(what: str, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{what}: {rule}; this model has no HF equivalent here. Fix: {fix}")


# ------------------------------------------------------------------ our config -> config.json
def check_exportable(mc: ModelConfig) -> None:
    """An MLA model exports as DeepSeek-V3 only when it is DeepSeek's: MoE after k dense
    layers, sigmoid routing with a top-2 group score, a shared expert of whole experts, no
    more than one MTP module."""
    if mc.num_experts is None:
        raise _refuse(
            "model.multi_latent_attention=true on a dense model",
            "the one MLA family here, DeepSeek-V3, is MoE after first_k_dense_replace layers",
            "export an MLA model with model.num_experts set",
        )
    pattern = resolve.moe_layer_pattern(mc)
    k = pattern.index(True) if True in pattern else len(pattern)
    f, shared = resolve.moe_ffn_hidden_size(mc), mc.moe_shared_expert_ffn_hidden_size
    groups, group_topk = mc.moe_router_num_groups or 1, mc.moe_router_group_topk or 1
    scores_differ = (
        mc.moe_router_group_score != "top2" and groups > 1 and mc.moe_router_topk != 2 * group_topk
    )
    unsupported = {
        f"moe_layer_freq={mc.moe_layer_freq}": not all(pattern[k:]),
        f"moe_router_score_function={mc.moe_router_score_function}": (
            mc.moe_router_score_function != "sigmoid"
        ),
        f"moe_shared_expert_ffn_hidden_size={shared}": shared == 0 or shared % f != 0,
        "moe_shared_expert_gate=true": mc.moe_shared_expert_gate,
        f"moe_router_group_score={mc.moe_router_group_score}": scores_differ,
        f"mtp_num_layers={mc.mtp_num_layers}": mc.mtp_num_layers > 1,
        f"moe_aux_loss_type={mc.moe_aux_loss_type}": (
            mc.moe_aux_loss_coeff > 0 and mc.moe_aux_loss_type != "seq"
        ),
    }
    bad_keys = [key for key, v in unsupported.items() if v]
    if bad_keys:
        raise _refuse(
            f"model.{bad_keys}",
            "DeepSeek-V3 (the MLA family here) has MoE on every layer after the first k, "
            "sigmoid routing with groups scored by their top 2, shared experts of "
            f"moe_ffn_hidden_size={f} each and no gate, at most one MTP module and a "
            "sequence-wise aux loss",
            "export a DeepSeek-V3-shaped model (the model keys hf-to-dcp writes for one)",
        )


def _rope_parameters(mc: ModelConfig) -> dict:
    out = {"rope_type": "default", "rope_theta": mc.rope_theta}
    if mc.rope_scaling:
        rs = {k: v for k, v in mc.rope_scaling.items() if k not in ("type", "rope_type")}
        out = {**rs, "rope_type": "yarn", "rope_theta": mc.rope_theta}
    return out


def to_hf_config(mc: ModelConfig, common: dict) -> dict:
    """config.json of our MLA model as DeepSeek-V3 (`common`: the fields every family writes),
    every field transformers' DeepseekV3Config reads written out, and the published config's
    own routing fields."""
    check_exportable(mc)
    pattern = resolve.moe_layer_pattern(mc)
    f, k = resolve.moe_ffn_hidden_size(mc), mc.moe_router_topk
    norm = mc.moe_router_norm_topk
    drop = ("head_dim", "rope_theta")  # HF derives head_dim; theta is in rope_parameters
    out = {key: v for key, v in common.items() if key not in drop}
    return out | {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        "num_key_value_heads": mc.num_attention_heads,  # class default 128
        "moe_intermediate_size": f,
        "n_routed_experts": mc.num_experts,
        "n_shared_experts": mc.moe_shared_expert_ffn_hidden_size // f,
        "num_experts_per_tok": k,
        "routed_scaling_factor": mc.moe_router_topk_scaling_factor or 1.0,
        "n_group": mc.moe_router_num_groups or 1,
        "topk_group": mc.moe_router_group_topk or 1,
        "norm_topk_prob": bool(k > 1 if norm is None else norm),  # sigmoid's default
        "first_k_dense_replace": pattern.index(True),
        "kv_lora_rank": mc.kv_lora_rank,
        "q_lora_rank": mc.q_lora_rank,
        "qk_nope_head_dim": mc.qk_head_dim,
        "qk_head_dim": mc.qk_head_dim + mc.qk_pos_emb_head_dim,  # HF's: nope + rope
        "qk_rope_head_dim": mc.qk_pos_emb_head_dim,
        "v_head_dim": mc.v_head_dim,
        "rope_parameters": _rope_parameters(mc),
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": mc.mtp_num_layers,
        "output_router_logits": False,
        **EXTRA_DEFAULTS,
        "aux_loss_alpha": mc.moe_aux_loss_coeff,
        "seq_aux": True,
    }


# ------------------------------------------------------------------ config.json -> our config
def _unsupported(c: dict, rope: dict) -> list[str]:
    """Fields of a DeepSeek-V3 config.json whose value megatron_lite cannot represent."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    unknown = sorted(set(rope) - {*rope_scaling.KEYS, "rope_theta"})
    eps = c.get("rms_norm_eps", HF_DEFAULTS["deepseek_v3"]["rms_norm_eps"])
    unsupported = {
        f"rope_type {kind} (only yarn or default)": kind not in ("default", "yarn"),
        f"rope parameters {unknown}": bool(unknown),
        "rope_interleave=false (the published checkpoints rotate interleaved pairs)": (
            c.get("rope_interleave") is False
        ),
        "attention_bias": c.get("attention_bias", False),
        f"hidden_act {c.get('hidden_act')}": c.get("hidden_act", "silu") != "silu",
        f"rms_norm_eps={eps} (HF's MLA norms use 1e-6 whatever it is; ours use it)": eps != 1e-6,
    }
    for key, want in EXTRA_DEFAULTS.items():
        if key in ("topk_method", "scoring_func", "moe_layer_freq") and key in c:
            unsupported[f"{key}={c[key]!r} (transformers computes {want!r})"] = c[key] != want
    return [k for k, v in unsupported.items() if v]


def _rope(c: dict, rope: dict, file: str) -> dict | None:
    """The YaRN mapping model.rope_scaling takes, or None (plain RoPE)."""
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return None
    out = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = "yarn"
    if out.get("factor") is None and out.get("original_max_position_embeddings"):
        out["factor"] = (
            c.get("max_position_embeddings", 4096) / out["original_max_position_embeddings"]
        )  # HF's rule for a YaRN without factor
    for key in ("factor", "original_max_position_embeddings"):
        if out.get(key) is None:
            raise bad(file, f"rope_parameters.{key}", None, "YaRN needs it", ORIGINAL)
    return out


def from_hf_config(c: dict, out: dict, file: str) -> dict:
    """A DeepSeek-V3 config.json (checked by tools/hf_checks.py, missing fields already at
    their transformers class defaults) -> our model.* keys over the common ones `out`."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    bad_fields = _unsupported(c, rope)
    if bad_fields:
        raise CheckpointError(
            f"{file}: this HF deepseek_v3 config uses what megatron_lite lacks: {bad_fields}. "
            "Fix: convert a model without them"
        )
    extra = EXTRA_DEFAULTS | {k: c[k] for k in EXTRA_DEFAULTS if k in c}
    f, groups = c["moe_intermediate_size"], c["n_group"]
    out = {k: v for k, v in out.items() if k != "kv_channels"}  # MLA's widths are its own
    return out | {
        "multi_latent_attention": True,
        "q_lora_rank": c["q_lora_rank"],
        "kv_lora_rank": c["kv_lora_rank"],
        "qk_head_dim": c["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": c["qk_rope_head_dim"],
        "v_head_dim": c["v_head_dim"],
        "rope_scaling": _rope(c, rope, file),
        "num_experts": c["n_routed_experts"],
        "moe_ffn_hidden_size": f,
        "moe_shared_expert_ffn_hidden_size": c["n_shared_experts"] * f,
        "moe_first_k_dense_replace": c["first_k_dense_replace"],
        "moe_router_topk": c["num_experts_per_tok"],
        "moe_router_score_function": "sigmoid",
        "moe_router_norm_topk": bool(c["norm_topk_prob"]),
        "moe_router_topk_scaling_factor": float(c["routed_scaling_factor"]),
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": c["topk_group"] if groups > 1 else None,
        "moe_router_group_score": "top2",
        "moe_aux_loss_coeff": float(extra["aux_loss_alpha"]),
        "moe_aux_loss_type": "seq" if extra["seq_aux"] else "global",
        "mtp_num_layers": c["num_nextn_predict_layers"],  # settled by the weights: settle_mtp
    }


# ------------------------------------------------------------------ the weights
def settle_mtp(
    m: dict, hf: dict[str, torch.Tensor], keep: bool = True, file: str = "config.json"
) -> tuple[dict, dict, list[str]]:
    """Whether the weights' layers N.. (num_hidden_layers, the MTP modules) become our MTP:
    (our model keys, the weights without those layers where they are dropped, messages for the
    user). `keep` False: --no-mtp. More than one module is refused unless dropped."""
    if m.get("multi_latent_attention") is not True:
        return m, hf, []
    n, mtp = m["num_layers"], m.get("mtp_num_layers", 0)
    if mtp > 1 and keep:
        raise bad(
            file,
            "num_nextn_predict_layers",
            mtp,
            "more than one MTP module is not imported (the published models have one)",
            "convert with --no-mtp to drop the MTP layers",
        )
    prefixes = tuple(f"model.layers.{n + j}." for j in range(max(mtp, 1)))
    held = any(k.startswith(prefixes) for k in hf)
    if mtp == 1 and held and keep:
        return m, hf, []
    notes = []
    if held:
        why = "--no-mtp" if not keep else "config.json's num_nextn_predict_layers=0"
        notes.append(f"dropped the MTP module (the weights' layers >= {n}) as {why} asks")
        hf = {k: v for k, v in hf.items() if not k.startswith(prefixes)}
    elif mtp:
        notes.append(
            f"num_nextn_predict_layers={mtp} but the weights hold no layer {n} "
            "(transformers' from_pretrained drops it): converted without MTP"
        )
    return {**m, "mtp_num_layers": 0}, hf, notes


def dequantize_fp8(
    c: dict, hf: dict[str, torch.Tensor], file: str, where=lambda name: ""
) -> dict[str, torch.Tensor]:
    """The published FP8 weights in float32: each `X.weight` of dtype float8 times its
    `X.weight_scale_inv` [ceil(rows/b0), ceil(cols/b1)] per b0×b1 block (weight_block_size of
    quantization_config), the scales removed; anything else as it is."""
    scales = [k for k in hf if k.endswith(SCALE_SUFFIX)]
    if not scales:
        return hf
    q = c.get("quantization_config") or {}
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise bad(
            file,
            "quantization_config",
            q or None,
            f"the weights hold {len(scales)} FP8 scales ({scales[0]}, ...) but no fp8 "
            "quantization_config with a weight_block_size [rows, cols]",
            ORIGINAL,
        )
    out = {k: v for k, v in hf.items() if not k.endswith(SCALE_SUFFIX)}
    for key in scales:
        name = key[: -len(SCALE_SUFFIX)] + ".weight"
        w, s = hf.get(name), hf[key]
        want = (
            None
            if w is None
            else tuple(math.ceil(d / b) for d, b in zip(w.shape, block, strict=False))
        )
        if w is None or w.dim() != 2 or tuple(s.shape) != want:
            raise CheckpointError(
                f"the HF weights{where(key)}: {key} has shape {list(s.shape)}, but {name} is "
                f"{'missing' if w is None else list(w.shape)} (blocks {block}). Fix: download "
                "the model's weights again"
            )
        scale = s.float().repeat_interleave(block[0], 0)[: w.shape[0]]
        scale = scale.repeat_interleave(block[1], 1)[:, : w.shape[1]]
        out[name] = w.float() * scale  # [rows, cols]
    return out
