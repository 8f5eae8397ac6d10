"""Tiny Hugging Face directories written by hand (no transformers: names and shapes typed from
the model families' own layouts, independent of tools/hf_families.py), and the helpers the
converter's bad-input and safety tests share."""

from __future__ import annotations

import hashlib
import json
import os

import torch

H, V, FFN = 8, 16, 16  # hidden, vocab, dense MLP width; 2 heads of 4, 1 KV head


def _attn(i: int, qk_norm: bool) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    out = {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (8, H),
        p + "self_attn.k_proj.weight": (4, H),
        p + "self_attn.v_proj.weight": (4, H),
        p + "self_attn.o_proj.weight": (H, 8),
    }
    if qk_norm:
        out |= {p + "self_attn.q_norm.weight": (4,), p + "self_attn.k_norm.weight": (4,)}
    return out


def _dense(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}.mlp."
    return {
        p + "gate_proj.weight": (FFN, H),
        p + "up_proj.weight": (FFN, H),
        p + "down_proj.weight": (H, FFN),
    }


COMMON = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": FFN, "num_attention_heads": 2,
    "num_key_value_heads": 1, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip


def family_layout(family: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(config.json, {tensor name: shape}) of a tiny llama (1 layer), mixtral (1 MoE layer, 2
    experts) or qwen3_moe (layer 0 dense, layer 1 MoE with 2 experts, q/k norms)."""
    top = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
    if family == "llama":
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
        config["num_hidden_layers"] = 1
        return COMMON | config, top | _attn(0, False) | _dense(0)
    if family == "mixtral":
        config = {"model_type": "mixtral", "num_hidden_layers": 1, "intermediate_size": 4,
                  "num_local_experts": 2, "num_experts_per_tok": 1}  # fmt: skip
        config["sliding_window"] = None
        p = "model.layers.0.block_sparse_moe."
        moe = {p + "gate.weight": (2, H)}
        for e in range(2):
            moe |= {f"{p}experts.{e}.w1.weight": (4, H), f"{p}experts.{e}.w3.weight": (4, H)}
            moe[f"{p}experts.{e}.w2.weight"] = (H, 4)
        return COMMON | config, top | _attn(0, False) | moe
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 2,
              "num_experts_per_tok": 1, "moe_intermediate_size": 4, "mlp_only_layers": [0],
              "decoder_sparse_step": 1, "norm_topk_prob": True, "head_dim": 4}  # fmt: skip
    p = "model.layers.1.mlp."
    moe = {p + "gate.weight": (2, H)}
    for e in range(2):
        moe |= {f"{p}experts.{e}.{w}.weight": (4, H) for w in ("gate_proj", "up_proj")}
        moe[f"{p}experts.{e}.down_proj.weight"] = (H, 4)
    return COMMON | config, top | _attn(0, True) | _dense(0) | _attn(1, True) | moe


def write_hf(path, family: str = "llama", config=None, shapes=None, seed: int = 0) -> str:
    """Write a tiny HF directory (config.json + model.safetensors) of random weights."""
    from safetensors.torch import save_file

    default_config, default_shapes = family_layout(family)
    config = default_config if config is None else config
    shapes = default_shapes if shapes is None else shapes
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def snapshot(path) -> dict[str, str]:
    """{relative path: sha256 or 'dir'} of everything under `path` (links not followed)."""
    out = {}
    for root, dirs, names in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path)] = "dir"
        for n in names:
            full = os.path.join(root, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def without_marker(snap: dict[str, str]) -> dict[str, str]:
    """A snapshot without the converter's marker (it names the writing process)."""
    return {k: v for k, v in snap.items() if k != ".megatron_lite_convert.json"}
