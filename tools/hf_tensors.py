"""The tensors of the Hugging Face families tools/convert_checkpoint.py converts (their configs:
tools/hf_families.py): HF names against ours, shapes from the config, and the conversion both
ways.

Our checkpoints store fused tensors per segment (q/k/v weights and biases, gate/up) except the
stacked experts: `mlp.experts.weight1` [E, 2·ffn, h] ([gate; up] per expert) and
`mlp.experts.weight2` [E, h, ffn], which HF stores one matrix per expert (Mixtral w1 = gate,
w3 = up, w2 = down; Qwen2/3-MoE gate_proj, up_proj, down_proj). Qwen2-MoE's shared expert is our
`mlp.shared_expert` (a dense MLP) and its gate [1, h] our `mlp.shared_expert_gate`.
DeepSeek-V3 (its decisions: tools/hf_deepseek.py): MLA's tensors keep HF's names under
`self_attention.`, the router's `e_score_correction_bias` is our `mlp.router.expert_bias`, the
shared experts `mlp.shared_experts` our `mlp.shared_expert`, and the MTP layer N
(num_hidden_layers) our `mtp.layers.0.*`.
"""

from __future__ import annotations

import os
import re
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

ATTENTION_NORMS = {  # ours (under layers.<i>.) -> HF (under model.layers.<i>.)
    "input_norm.weight": "input_layernorm.weight",
    "pre_mlp_norm.weight": "post_attention_layernorm.weight",
}
ATTENTION = {
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
    "deepseek_v3": ("mlp.gate.weight", _QWEN_EXPERTS),
}
MLA = {  # model.multi_latent_attention (DeepSeek-V3): HF's names under self_attention.
    f"self_attention.{n}.weight": f"self_attn.{n}.weight"
    for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
}
MLA_Q = ("q_proj",)  # q_lora_rank null
MLA_Q_LORA = ("q_a_proj", "q_a_layernorm", "q_b_proj")
DEEPSEEK_MOE = {  # no shared expert gate; the selection bias of aux-loss-free balancing
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_expert.linear_fc1.weight/gate": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_expert.linear_fc1.weight/up": "mlp.shared_experts.up_proj.weight",
    "mlp.shared_expert.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
MTP = {  # module 1 of our MTP (models/mtp.py) <- DeepSeek-V3's layer N = num_hidden_layers
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_norm.weight": "shared_head.norm.weight",
}
# layer N's copies of the shared embedding and output head: read (equal to the model's) and
# written back, never stored twice in our checkpoints
MTP_SHARED = {"embed_tokens.weight": "embedding.weight", "shared_head.head.weight": "output"}


def _layer_names(mc: ModelConfig, family: str, i: int, moe: bool) -> dict[str, str]:
    """Ours -> HF for a layer's tensors that map one to one (not the stacked experts), relative
    to the layer (`moe`: whether its MLP is MoE)."""
    if family == "deepseek_v3":
        q = MLA_Q if mc.q_lora_rank is None else MLA_Q_LORA
        names = (
            dict(ATTENTION_NORMS)
            | MLA
            | {f"self_attention.{n}.weight": f"self_attn.{n}.weight" for n in q}
        )
    else:
        names = dict(ATTENTION)
    if mc.add_qkv_bias:
        names |= QKV_BIASES
    if mc.qk_layernorm:
        names |= QK_NORMS
    if moe:
        names["mlp.router.weight"] = MOE[family][0]
        if family == "deepseek_v3":
            names |= DEEPSEEK_MOE
        elif mc.moe_shared_expert_ffn_hidden_size:
            names |= SHARED_EXPERT
    else:
        names |= DENSE_MLP
    return names


def mtp_layer(mc: ModelConfig) -> int | None:
    """The HF layer index of DeepSeek-V3's MTP module (num_hidden_layers) when our model has
    one (model.mtp_num_layers = 1), else None."""
    return mc.num_layers if mc.mtp_num_layers else None


def _blocks(mc: ModelConfig, family: str) -> list[tuple[str, str, bool]]:
    """(our prefix, HF prefix, is MoE) of every transformer layer: the main ones, then the MTP
    module's (DeepSeek-V3's layer N)."""
    out = [
        (f"layers.{i}.", f"model.layers.{i}.", resolve.is_moe_layer(mc, i))
        for i in range(mc.num_layers)
    ]
    n = mtp_layer(mc)
    if n is not None:
        out.append(("mtp.layers.0.layer.", f"model.layers.{n}.", resolve.mtp_moe_pattern(mc)[0]))
    return out


def name_map(mc: ModelConfig, family: str) -> dict[str, str]:
    """Our logical tensor names -> HF names, for the tensors that map one to one."""
    out = {
        "embedding.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
    }
    if not mc.tie_embeddings:
        out["output_layer.weight"] = "lm_head.weight"
    for ours, hf, moe in _blocks(mc, family):
        out |= {ours + k: hf + v for k, v in _layer_names(mc, family, 0, moe).items()}
    n = mtp_layer(mc)
    if n is not None:
        out |= {f"mtp.layers.0.{k}": f"model.layers.{n}.{v}" for k, v in MTP.items()}
    return out


def _expert_names(mc: ModelConfig, family: str, hf_prefix: str) -> tuple[list[str], ...]:
    """HF (gate, up, down) names of each of a layer's experts: three lists of E names."""
    per_expert = MOE[family][1]
    return tuple([hf_prefix + w.format(e=e) for e in range(mc.num_experts)] for w in per_expert)


def _moe_blocks(mc: ModelConfig, family: str) -> list[tuple[str, str]]:
    return [(ours, hf) for ours, hf, moe in _blocks(mc, family) if moe]


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
        "mlp.router.expert_bias": (mc.num_experts or 0,),
    } | _mla_shapes(mc)


def _mla_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """MLA's tensors (models/mla.py) and the MTP module's own, by suffix."""
    h, n = mc.hidden_size, mc.num_attention_heads
    dn, dr, dv = mc.qk_head_dim, mc.qk_pos_emb_head_dim, mc.v_head_dim
    ql, kl = mc.q_lora_rank or 0, mc.kv_lora_rank
    shapes = {
        "q_proj": (n * (dn + dr), h),
        "q_a_proj": (ql, h),
        "q_a_layernorm": (ql,),
        "q_b_proj": (n * (dn + dr), ql),
        "kv_a_proj_with_mqa": (kl + dr, h),
        "kv_a_layernorm": (kl,),
        "kv_b_proj": (n * (dn + dv), kl),
        "o_proj": (h, n * dv),
    }
    out = {f"self_attention.{k}.weight": v for k, v in shapes.items()}
    mtp = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h)}
    return out | mtp


_PREFIX = re.compile(r"^(?:mtp\.layers\.\d+\.layer\.|mtp\.layers\.\d+\.|layers\.\d+\.)")


def _suffix(name: str) -> str:
    """A tensor's name without its layer prefix (layers.<i>., mtp.layers.<j>.[layer.])."""
    return _PREFIX.sub("", name)


def our_shapes(mc: ModelConfig, family: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's full shape by our logical name, as config `mc` and `vocab` give it (the
    experts stacked: weight1 [E, 2·ffn, h], weight2 [E, h, ffn])."""
    by_suffix = _one_to_one_shapes(mc, vocab)
    ours = {k: by_suffix[_suffix(k)] for k in name_map(mc, family)}
    h, f, e = mc.hidden_size, resolve.moe_ffn_hidden_size(mc), mc.num_experts
    for prefix, _ in _moe_blocks(mc, family):
        ours[f"{prefix}mlp.experts.weight1"] = (e, 2 * f, h)
        ours[f"{prefix}mlp.experts.weight2"] = (e, h, f)
    return ours


def hf_shapes(mc: ModelConfig, family: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """The same by HF name (one matrix per expert)."""
    names = name_map(mc, family)
    ours = our_shapes(mc, family, vocab)
    out = {names[k]: s for k, s in ours.items() if k in names}
    h, f = mc.hidden_size, resolve.moe_ffn_hidden_size(mc)
    for _, hf_prefix in _moe_blocks(mc, family):
        gate, up, down = _expert_names(mc, family, hf_prefix)
        out |= {n: (f, h) for n in gate + up} | {n: (h, f) for n in down}
    n = mtp_layer(mc)
    if n is not None:  # layer N's copies of the embedding and the output head
        out |= {f"model.layers.{n}.{k}": (vocab, h) for k in MTP_SHARED}
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
    blocks = _moe_blocks(mc, family)
    stacked = {f"{prefix}mlp.experts.weight{j}" for prefix, _ in blocks for j in (1, 2)}
    if family == "deepseek_v3" and not mc.moe_router_enable_expert_bias:
        names = {k: v for k, v in names.items() if not k.endswith("router.expert_bias")}
    _check_names(set(names) | stacked, set(tensors), "the checkpoint")
    vocab = tensors["embedding.weight"].shape[0]
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    check_shapes(shapes, our_shapes(mc, family, vocab), _dtypes(tensors), "the checkpoint")
    out = {names[k]: t for k, t in tensors.items() if k in names}
    f = resolve.moe_ffn_hidden_size(mc) if blocks else 0
    for prefix, hf_prefix in blocks:
        w1 = tensors[f"{prefix}mlp.experts.weight1"]  # [E, 2·ffn, h]: [gate; up]
        w2 = tensors[f"{prefix}mlp.experts.weight2"]  # [E, h, ffn]
        gate, up, down = _expert_names(mc, family, hf_prefix)
        for e in range(mc.num_experts):  # clones: safetensors refuses views of one storage
            out[gate[e]], out[up[e]] = w1[e, :f].clone(), w1[e, f:].clone()
            out[down[e]] = w2[e].clone()
        bias = hf_prefix + DEEPSEEK_MOE["mlp.router.expert_bias"]
        if family == "deepseek_v3" and bias not in out:  # no expert bias: HF's zeros
            out[bias] = torch.zeros(mc.num_experts, dtype=torch.float32)
    n = mtp_layer(mc)
    if n is not None:  # layer N holds its own copies of the shared embedding and head
        head = tensors["embedding.weight" if mc.tie_embeddings else "output_layer.weight"]
        out[f"model.layers.{n}.embed_tokens.weight"] = tensors["embedding.weight"].clone()
        out[f"model.layers.{n}.shared_head.head.weight"] = head.clone()
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
    layers = mc.num_layers + (mtp_layer(mc) is not None)
    check_count(hf, layers, "the HF weights", "num_hidden_layers")
    if mc.num_experts is not None:
        key = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}
        check_expert_count(hf, mc.num_experts, "the HF weights", key.get(family, "num_experts"))
    want = hf_shapes(mc, family, m["vocab_size"])
    _check_names(set(want), set(hf), "the HF weights")
    shapes = {k: tuple(t.shape) for k, t in hf.items()}
    check_shapes(shapes, want, _dtypes(hf), "the HF weights", where)
    back = {v: k for k, v in name_map(mc, family).items()}
    out = {back[k]: t for k, t in hf.items() if k in back}
    for prefix, hf_prefix in _moe_blocks(mc, family):
        gate, up, down = _expert_names(mc, family, hf_prefix)
        gates, ups = torch.stack([hf[n] for n in gate]), torch.stack([hf[n] for n in up])
        out[f"{prefix}mlp.experts.weight1"] = torch.cat([gates, ups], dim=1)  # [E, 2f, h]
        out[f"{prefix}mlp.experts.weight2"] = torch.stack([hf[n] for n in down])  # [E, h, f]
    n = mtp_layer(mc)
    if n is not None:
        _check_mtp_copies(mc, hf, n)
    return out


def _check_mtp_copies(mc: ModelConfig, hf: dict[str, torch.Tensor], n: int) -> None:
    """Layer N's embed_tokens and shared_head.head must equal the model's: our MTP shares them
    (DeepSeek-V3 §2.2), so a checkpoint whose copies differ has no equivalent here."""
    head = "model.embed_tokens.weight" if mc.tie_embeddings else "lm_head.weight"
    pairs = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": head}
    for copy, main in pairs.items():
        if not torch.equal(hf[f"model.layers.{n}.{copy}"], hf[main]):
            raise CheckpointError(
                f"the HF weights: model.layers.{n}.{copy} (the MTP module's) differs from "
                f"{main}: our MTP shares the embedding and the output head with the model, as "
                "DeepSeek-V3 does. Fix: convert with --no-mtp to drop the MTP layer"
            )


def _check_names(expected: set[str], present: set[str], what: str) -> None:
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing or extra:
        raise CheckpointError(
            f"{what}: tensors missing {missing[:4]}, unexpected {extra[:4]} "
            f"({len(missing)} missing, {len(extra)} unexpected). Fix: convert a complete "
            "model whose config.json belongs to its weights"
        )
