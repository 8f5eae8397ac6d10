"""The tensors of the Hugging Face families tools/convert_checkpoint.py converts (their configs:
tools/hf_families.py): HF names against ours, shapes from the config, and the conversion both
ways.

Our checkpoints store fused tensors per segment (q/k/v weights and biases, gate/up) except the
stacked experts: `mlp.experts.weight1` [E, 2·ffn, h] ([gate; up] per expert) and
`mlp.experts.weight2` [E, h, ffn], which HF stores one matrix per expert (Mixtral w1 = gate,
w3 = up, w2 = down; Qwen2/3-MoE gate_proj, up_proj, down_proj). Qwen2-MoE's shared expert is our
`mlp.shared_expert` (a dense MLP) and its gate [1, h] our `mlp.shared_expert_gate`.
"""

from __future__ import annotations

import os
import sys

import torch

# Run as a script from a checkout (`python tools/hf_tensors.py`): make `tools` importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from megatron_lite import resolve  # noqa: E402
from megatron_lite.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from tools.hf_checks import (  # noqa: E402
    check_count,
    check_expert_count,
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
QKV_BIASES = {  # model.add_qkv_bias (Qwen2)
    "self_attention.linear_qkv.bias/q": "self_attn.q_proj.bias",
    "self_attention.linear_qkv.bias/k": "self_attn.k_proj.bias",
    "self_attention.linear_qkv.bias/v": "self_attn.v_proj.bias",
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
SHARED_EXPERT = {  # Qwen2-MoE (model.moe_shared_expert_ffn_hidden_size, moe_shared_expert_gate)
    "mlp.shared_expert.linear_fc1.weight/gate": "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.linear_fc1.weight/up": "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate": "mlp.shared_expert_gate.weight",
}
_QWEN_EXPERTS = tuple(
    f"mlp.experts.{{e}}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")
)
# family: (router, per-expert (gate, up, down) with {e} for the expert index), under the layer
MOE = {
    "mixtral": (
        "block_sparse_moe.gate.weight",
        tuple(f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")),
    ),
    "qwen3_moe": ("mlp.gate.weight", _QWEN_EXPERTS),
    "qwen2_moe": ("mlp.gate.weight", _QWEN_EXPERTS),
}


def _layer_names(mc: ModelConfig, family: str, i: int) -> dict[str, str]:
    """Ours -> HF for layer i's tensors that map one to one (not the stacked experts)."""
    names = dict(ATTENTION)
    if mc.add_qkv_bias:
        names |= QKV_BIASES
    if mc.qk_layernorm:
        names |= QK_NORMS
    if resolve.is_moe_layer(mc, i):
        names["mlp.router.weight"] = MOE[family][0]
        if mc.moe_shared_expert_ffn_hidden_size:
            names |= SHARED_EXPERT
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
    f, shared = resolve.ffn_hidden_size(mc), mc.moe_shared_expert_ffn_hidden_size
    return {
        "embedding.weight": (vocab, h),
        "final_norm.weight": (h,),
        "output_layer.weight": (vocab, h),
        "input_norm.weight": (h,),
        "self_attention.linear_qkv.weight/q": (q, h),
        "self_attention.linear_qkv.weight/k": (kv, h),
        "self_attention.linear_qkv.weight/v": (kv, h),
        "self_attention.linear_qkv.bias/q": (q,),
        "self_attention.linear_qkv.bias/k": (kv,),
        "self_attention.linear_qkv.bias/v": (kv,),
        "self_attention.linear_proj.weight": (h, q),
        "pre_mlp_norm.weight": (h,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "mlp.linear_fc1.weight/gate": (f, h),
        "mlp.linear_fc1.weight/up": (f, h),
        "mlp.linear_fc2.weight": (h, f),
        "mlp.router.weight": (mc.num_experts or 0, h),
        "mlp.shared_expert.linear_fc1.weight/gate": (shared, h),
        "mlp.shared_expert.linear_fc1.weight/up": (shared, h),
        "mlp.shared_expert.linear_fc2.weight": (h, shared),
        "mlp.shared_expert_gate": (1, h),
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
    from tools.hf_families import family_of, full_model_config

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
    from tools.hf_families import family_of, full_model_config

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
    out = {back[k]: t for k, t in hf.items() if k in back}
    for i in range(mc.num_layers):
        if not resolve.is_moe_layer(mc, i):
            continue
        gate, up, down = _expert_names(mc, family, i)
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
