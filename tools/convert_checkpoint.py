"""Convert between megatron_lite checkpoints and Hugging Face Llama, Mixtral and Qwen3-MoE.

HF directories hold safetensors + config.json for LlamaForCausalLM, MixtralForCausalLM or
Qwen3MoeForCausalLM.

    python tools/convert_checkpoint.py dcp-to-hf runs/x/checkpoints/step_1000 hf/llama-x
    python tools/convert_checkpoint.py hf-to-dcp hf/llama-x ckpt/llama-x
    python -m megatron_lite.train --config ... train.init_from=ckpt/llama-x   # start from it

Loading never runs code from the files: DCP's pickled `.metadata` is read through an
allow-list (megatron_lite/checkpoint/dcp_metadata.py) and HF weights only through safetensors.

dcp-to-hf writes model.safetensors (float32, or --dtype bfloat16) and a config.json that
transformers loads: a dense model as Llama, an MoE model with q/k norms (model.qk_layernorm) as
Qwen3-MoE (dense layers in mlp_only_layers), one without as Mixtral (every layer MoE,
moe_router_norm_topk=true). hf-to-dcp reads the family from config.json's model_type and writes
a model-only checkpoint (kind "model", step 0) that `train.init_from` loads on any layout
(tp/pp/cp/ep): weights only, fresh optimizer, step 0; the model.* config keys must match the
converted model (shown in its metadata.json).

Names map one to one (tools/hf_families.py); fused tensors are stored per segment in our
checkpoints (q/k/v, gate/up), so no splitting is needed except the stacked experts [E, ...],
which HF stores one matrix per expert. Rotary embeddings use the same half-rotation convention
(pairs i and i + d/2, HF's rotate_half), so q/k need no permutation. Only arch=llama converts;
a field we do not implement (rope scaling, biases, sliding windows, sigmoid routing, ...) is an
error naming it.
"""

from __future__ import annotations

import argparse
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
from tools.hf_families import (  # noqa: E402
    from_hf_config,
    from_hf_tensors,
    to_hf_config,
    to_hf_tensors,
)


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


# ------------------------------------------------------------------ conversions
def dcp_to_hf(ckpt: str, out_dir: str, dtype: torch.dtype = torch.float32) -> None:
    from safetensors.torch import save_file

    meta, tensors = read_model(ckpt)
    m = meta["config"]["model"]
    hf_config = to_hf_config(m, vocab_size=tensors["embedding.weight"].shape[0])
    try:
        hf = to_hf_tensors(m, tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt}: {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    hf = {k: t.to(dtype).contiguous() for k, t in hf.items()}
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
    try:
        tensors = from_hf_tensors(m, hf)
    except CheckpointError as e:
        raise CheckpointError(f"{hf_dir}: {e}") from None
    write_model(out, tensors, m, source=os.path.abspath(hf_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("dcp-to-hf", help="our checkpoint -> HF Llama/Mixtral/Qwen3-MoE directory")
    a.add_argument("checkpoint", help="step_<N> directory (or a folder with `latest`)")
    a.add_argument("out_dir")
    a.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    b = sub.add_parser(
        "hf-to-dcp", help="HF Llama/Mixtral/Qwen3-MoE directory -> model-only checkpoint"
    )
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
