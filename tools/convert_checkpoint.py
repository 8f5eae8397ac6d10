"""Convert between megatron_lite checkpoints and Hugging Face Llama (safetensors + config.json).

    python tools/convert_checkpoint.py dcp-to-hf runs/x/checkpoints/step_1000 hf/llama-x
    python tools/convert_checkpoint.py hf-to-dcp hf/llama-x ckpt/llama-x
    python -m megatron_lite.train --config ... train.init_from=ckpt/llama-x   # start from it

Loading never runs code from the files: DCP's pickled `.metadata` is read through an
allow-list (megatron_lite/checkpoint/dcp_metadata.py) and HF weights only through safetensors.

dcp-to-hf writes model.safetensors (float32, or --dtype bfloat16) and a config.json that
transformers' LlamaForCausalLM loads. hf-to-dcp writes a model-only checkpoint (kind "model",
step 0) that `train.init_from` loads on any layout: weights only, fresh optimizer, step 0;
the model.* config keys must match the converted model (shown in its metadata.json).

Names map one to one; fused tensors are stored per segment in our checkpoints (q/k/v,
gate/up), so no splitting is needed. Rotary embeddings use the same half-rotation convention
(pairs i and i + d/2, HF's rotate_half), so q/k need no permutation. Only arch=llama converts.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import sys
import warnings

import torch

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed.checkpoint as dcp  # noqa: E402

from megatron_lite.checkpoint import files  # noqa: E402
from megatron_lite.checkpoint.chunks import ShardLoadPlanner, ShardSavePlanner  # noqa: E402
from megatron_lite.checkpoint.dcp_metadata import SafeFileSystemReader  # noqa: E402
from megatron_lite.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_lite.checkpoint.state import Piece  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402

LAYER = {  # ours (under layers.<i>.) -> HF (under model.layers.<i>.)
    "input_norm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight/q": "self_attn.q_proj.weight",
    "self_attention.linear_qkv.weight/k": "self_attn.k_proj.weight",
    "self_attention.linear_qkv.weight/v": "self_attn.v_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight/gate": "mlp.gate_proj.weight",
    "mlp.linear_fc1.weight/up": "mlp.up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def name_map(num_layers: int, tied: bool) -> dict[str, str]:
    """Our logical tensor names -> Hugging Face Llama parameter names."""
    out = {
        "embedding.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
    }
    if not tied:
        out["output_layer.weight"] = "lm_head.weight"
    for i in range(num_layers):
        out.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in LAYER.items()})
    return out


# ------------------------------------------------------------------ our checkpoints, one process
def _full_pieces(tensors: dict[str, torch.Tensor]) -> dict[str, Piece]:
    return {k: Piece(k, tuple(t.shape), (0,) * t.dim()) for k, t in tensors.items()}


def read_model(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata.json, {logical name: full tensor}) of a checkpoint's model, checksums checked
    and DCP's `.metadata` read through the allow-list (a crafted one is refused, not run)."""
    path = files.resolve(path)
    meta = files.verify(path)
    reader = SafeFileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    buffers = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in stored.items()
        if k.startswith("model/")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        dcp.load(
            buffers,
            storage_reader=reader,
            planner=ShardLoadPlanner(_full_pieces(buffers)),
            no_dist=True,
        )
    return meta, {k[len("model/") :]: t for k, t in buffers.items()}


def write_model(path: str, tensors: dict[str, torch.Tensor], model_cfg: dict, source: str) -> None:
    """A model-only checkpoint directory (kind "model", step 0) for train.init_from."""
    state = {f"model/{k}": t.detach().float().contiguous() for k, t in tensors.items()}
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(tmp),
            planner=ShardSavePlanner(_full_pieces(state)),
            no_dist=True,
        )
    meta = {
        "kind": "model",
        "step": 0,
        "layout": {"world_size": 1},
        "config": {"model": model_cfg},
        "source": source,
    }
    files.commit(tmp, path, meta)


# ------------------------------------------------------------------ configs
def to_hf_config(m: dict, vocab_size: int) -> dict:
    """Our model config (dict of ModelConfig) -> a Llama config.json."""
    m = {**dataclasses.asdict(ModelConfig()), **m}  # model-only checkpoints hold a subset
    if m["arch"] != "llama" or m["num_experts"] is not None:
        raise CheckpointError(
            f"model.arch={m['arch']!r}, num_experts={m['num_experts']}: only dense llama "
            "models convert to HF Llama"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": m["hidden_size"],
        "intermediate_size": m["ffn_hidden_size"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_attention_heads"],
        "num_key_value_heads": m["num_query_groups"] or m["num_attention_heads"],
        "head_dim": m["hidden_size"] // m["num_attention_heads"],
        "max_position_embeddings": m["max_position_embeddings"] or m["seq_length"],
        "rms_norm_eps": m["norm_eps"],
        "rope_theta": m["rope_theta"],
        "tie_word_embeddings": m["tie_embeddings"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": m["init_method_std"],
        "torch_dtype": "float32",
    }


def from_hf_config(c: dict) -> dict:
    """A Llama config.json -> our model.* keys (checked for what we implement)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    unsupported = {
        "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
        "attention_bias": c.get("attention_bias", False),
        "mlp_bias": c.get("mlp_bias", False),
        "head_dim != hidden_size/num_attention_heads": head_dim * c["num_attention_heads"]
        != c["hidden_size"],
        f"hidden_act {c.get('hidden_act')}": c.get("hidden_act", "silu") != "silu",
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(f"this HF Llama config uses what megatron_lite lacks: {bad}")
    return {
        "arch": "llama",
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_query_groups": c.get("num_key_value_heads") or c["num_attention_heads"],
        "ffn_hidden_size": c["intermediate_size"],
        "vocab_size": c["vocab_size"],
        "max_position_embeddings": c.get("max_position_embeddings"),
        "tie_embeddings": c.get("tie_word_embeddings", False),
        "norm_eps": c.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
    }


# ------------------------------------------------------------------ conversions
def dcp_to_hf(ckpt: str, out_dir: str, dtype: torch.dtype = torch.float32) -> None:
    from safetensors.torch import save_file

    meta, tensors = read_model(ckpt)
    m = meta["config"]["model"]
    hf_config = to_hf_config(m, vocab_size=tensors["embedding.weight"].shape[0])
    names = name_map(m["num_layers"], m["tie_embeddings"])
    missing = sorted(set(names) - set(tensors))
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise CheckpointError(f"{ckpt}: tensors missing {missing[:4]}, unexpected {extra[:4]}")
    os.makedirs(out_dir, exist_ok=True)
    hf = {names[k]: t.to(dtype).contiguous() for k, t in tensors.items()}
    save_file(hf, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


def hf_to_dcp(hf_dir: str, out: str) -> None:
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        m = from_hf_config(json.load(f))
    hf = {}
    for file in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        hf.update(load_file(file))
    if not hf:
        raise CheckpointError(f"{hf_dir} has no *.safetensors files")
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    names = name_map(m["num_layers"], m["tie_embeddings"])
    if m["tie_embeddings"]:
        hf.pop("lm_head.weight", None)  # some exporters write the tied copy
    back = {v: k for k, v in names.items()}
    missing = sorted(set(back) - set(hf))
    extra = sorted(set(hf) - set(back))
    if missing or extra:
        raise CheckpointError(f"{hf_dir}: tensors missing {missing[:4]}, unexpected {extra[:4]}")
    write_model(out, {back[k]: t for k, t in hf.items()}, m, source=os.path.abspath(hf_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("dcp-to-hf", help="our checkpoint -> HF Llama directory")
    a.add_argument("checkpoint", help="step_<N> directory (or a folder with `latest`)")
    a.add_argument("out_dir")
    a.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    b = sub.add_parser("hf-to-dcp", help="HF Llama directory -> model-only checkpoint")
    b.add_argument("hf_dir")
    b.add_argument("out", help="checkpoint directory to create (use with train.init_from)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "dcp-to-hf":
            dcp_to_hf(args.checkpoint, args.out_dir, getattr(torch, args.dtype))
            print(f"wrote {args.out_dir}/model.safetensors and config.json")
        else:
            hf_to_dcp(args.hf_dir, args.out)
            print(f"wrote {args.out}; start training from it with train.init_from={args.out}")
    except (CheckpointError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
