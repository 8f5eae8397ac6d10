"""Convert between megatron_lite checkpoints and Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE,
Qwen2-MoE and DeepSeek-V3.

HF directories hold safetensors + config.json for LlamaForCausalLM, Qwen3ForCausalLM,
MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM or DeepseekV3ForCausalLM (its
MTP layer N imported as our MTP module, `--no-mtp` drops it; its FP8 weights dequantized:
tools/hf_deepseek.py).

    python tools/convert_checkpoint.py dcp-to-hf runs/x/checkpoints/step_1000 hf/llama-x
    python tools/convert_checkpoint.py hf-to-dcp hf/llama-x ckpt/llama-x
    python -m megatron_lite.train --config ... train.init_from=ckpt/llama-x   # start from it

Loading never runs code from the files: DCP's pickled `.metadata` is read through an
allow-list (megatron_lite/checkpoint/dcp_metadata.py) and HF weights only through safetensors.

dcp-to-hf writes model.safetensors (float32, or --dtype bfloat16) and a config.json that
transformers loads, every field it reads written out: a dense model as Llama, or as Qwen3 with
q/k norms (model.qk_layernorm); an MoE model with a gated shared expert as Qwen2-MoE (q/k/v
biases per model.add_qkv_bias), with q/k norms as Qwen3-MoE (dense layers in mlp_only_layers),
else as Mixtral (every layer MoE, moe_router_norm_topk=true); a model with multi-head latent
attention as DeepSeek-V3 (its MTP module as layer N). hf-to-dcp reads the family from
config.json's model_type (a missing field takes its transformers class default) and writes a
model-only checkpoint (kind "model", step 0) that `train.init_from` loads on any layout
(tp/pp/cp/ep): weights only, fresh optimizer, step 0; the model.* config keys must match the
converted model (shown in its metadata.json).

Names map one to one (tools/hf_tensors.py; the configs: tools/hf_families.py); fused tensors
are stored per segment in our checkpoints (q/k/v weights and biases, gate/up), so no splitting
is needed except the stacked experts [E, ...], which HF stores one matrix per expert. Rotary
embeddings use the same half-rotation convention (pairs i and i + d/2, HF's rotate_half), so
q/k need no permutation. An architecture converts
when its registry entry names these HF families (models/registry.py `hf_families`: llama does,
gpt names none); a field we do not implement (rope scaling, o_proj or MLP biases, sliding
windows, sigmoid routing, ...) is an error naming it.

Inputs are checked before anything is written (tools/hf_checks.py, tools/convert_inputs.py):
every config.json field read for presence, type and range, every tensor for its shape and
dtype against the config. The output is written by the rules of tools/convert_output.py: a new
or empty directory only (or, with --overwrite, one this converter wrote), never inside a run's
checkpoint folder, staged in a temporary sibling and renamed into place, so a kill at any
moment leaves the old output or the complete new one. Errors exit 2 with a message naming the
file and the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

import torch

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed.checkpoint as dcp  # noqa: E402

from megatron_lite.atomic import write_atomic  # noqa: E402
from megatron_lite.checkpoint import files  # noqa: E402
from megatron_lite.checkpoint.chunks import ShardLoadPlanner, ShardSavePlanner  # noqa: E402
from megatron_lite.checkpoint.dcp_metadata import SafeFileSystemReader  # noqa: E402
from megatron_lite.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_lite.checkpoint.state import Piece  # noqa: E402
from tools.convert_inputs import check_input_dir, read_hf_config, read_hf_tensors  # noqa: E402
from tools.convert_output import (  # noqa: E402
    MARKER,
    check_output,
    kill_point,
    staged_output,
    writing,
)
from tools.hf_deepseek import dequantize_fp8, settle_mtp  # noqa: E402
from tools.hf_families import (  # noqa: E402
    from_hf_config,
    from_hf_tensors,
    to_hf_config,
    to_hf_tensors,
)


# ------------------------------------------------------------------ our checkpoints, one process
def _full_pieces(tensors: dict[str, torch.Tensor]) -> dict[str, Piece]:
    return {k: Piece(k, tuple(t.shape), (0,) * t.dim()) for k, t in tensors.items()}


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory `path` names (itself, or its folder's latest), its
    metadata.json read and checked (fast: no hashing)."""
    check_input_dir(path, "a checkpoint: a step_<N> directory, or a checkpoint folder")
    path = files.resolve(path)
    files.read_metadata(path)
    return path


def read_model(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata.json, {logical name: full tensor}) of a checkpoint's model, checksums checked
    and DCP's `.metadata` read through the allow-list (a crafted one is refused, not run)."""
    path = resolve_checkpoint(path)
    meta = files.verify(path)
    model = meta["config"].get("model")
    if not isinstance(model, dict):
        raise CheckpointError(
            f"{path}/metadata.json has no model config (config.model): not a checkpoint of a "
            "model. Fix: point at a checkpoint that a run or hf-to-dcp wrote"
        )
    reader = SafeFileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    buffers = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in stored.items()
        if k.startswith("model/")
    }
    if "model/embedding.weight" not in buffers:
        raise CheckpointError(
            f"{path} holds no model weights (no model/embedding.weight in its .metadata). "
            "Fix: point at a checkpoint that a run or hf-to-dcp wrote"
        )
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore")
            dcp.load(
                buffers,
                storage_reader=reader,
                planner=ShardLoadPlanner(_full_pieces(buffers)),
                no_dist=True,
            )
    except CheckpointError:  # refused by our reader (e.g. a crafted .metadata): as it is
        raise
    except (OSError, RuntimeError, ValueError) as e:  # DCP wraps a failed read in its own error
        raise CheckpointError(
            f"could not read the tensors of {path}: {str(e)[:300]}. Fix: check the directory "
            "(permissions, the file system), or use another checkpoint"
        ) from None
    return meta, {k[len("model/") :]: t for k, t in buffers.items()}


def write_model(
    path: str, tensors: dict[str, torch.Tensor], model_cfg: dict, source: str, overwrite=False
) -> None:
    """A model-only checkpoint directory (kind "model", step 0) for train.init_from, written
    by the rules of tools/convert_output.py (never over anything it did not write)."""
    state = {f"model/{k}": t.detach().float().contiguous() for k, t in tensors.items()}
    with staged_output(path, overwrite, "hf-to-dcp", source, (source,)) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(tmp),
                planner=ShardSavePlanner(_full_pieces(state)),
                no_dist=True,
            )
        kill_point("writing")
        meta = {
            "format": files.FORMAT,
            "kind": "model",
            "step": 0,
            "layout": {"world_size": 1},
            "config": {"model": model_cfg},
            "source": source,
        }
        data = [n for n in files.data_files(tmp) if n != MARKER]  # the marker is rewritten
        meta["files"] = files.file_table(tmp, names=data)  # as files.commit, minus its rename
        write_atomic(os.path.join(tmp, files.METADATA), json.dumps(meta, indent=1, sort_keys=True))


# ------------------------------------------------------------------ conversions
def dcp_to_hf(
    ckpt: str, out_dir: str, dtype: torch.dtype = torch.float32, overwrite: bool = False
) -> None:
    from safetensors.torch import save_file

    check_output(out_dir, overwrite, (resolve_checkpoint(ckpt),))  # before the long reading
    meta, tensors = read_model(ckpt)
    m = meta["config"]["model"]
    try:
        hf = to_hf_tensors(m, tensors)
        hf_config = to_hf_config(m, vocab_size=tensors["embedding.weight"].shape[0])
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt}: {e}") from None
    hf = {k: t.to(keep_fp32(k, dtype)).contiguous() for k, t in hf.items()}
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with staged_output(out_dir, overwrite, "dcp-to-hf", ckpt, (ckpt,)) as tmp:
        weights = os.path.join(tmp, "model.safetensors")
        with writing(weights):
            save_file(hf, weights, metadata={"format": "pt"})
        kill_point("writing")
        write_atomic(os.path.join(tmp, "config.json"), json.dumps(hf_config, indent=2))


def keep_fp32(name: str, dtype: torch.dtype) -> torch.dtype:
    """DeepSeek-V3's selection bias stays float32 in any export (HF keeps it so)."""
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype


def hf_to_dcp(hf_dir: str, out: str, overwrite: bool = False, mtp: bool = True) -> None:
    """`mtp` False (--no-mtp): drop a DeepSeek-V3 MTP layer instead of importing it."""
    config, file = read_hf_config(hf_dir)
    m = from_hf_config(config, file)
    check_output(out, overwrite, (hf_dir,))  # before the long reading
    hf, where = read_hf_tensors(hf_dir)
    try:
        hf = dequantize_fp8(config, hf, file, lambda name: f" ({where.get(name, hf_dir)})")
        m, hf, notes = settle_mtp(m, hf, mtp, file)
        tensors = from_hf_tensors(m, hf, lambda name: f" ({where.get(name, hf_dir)})")
    except CheckpointError as e:
        raise CheckpointError(f"{hf_dir}: {e}") from None
    for note in notes:
        print(f"note: {hf_dir}: {note}", file=sys.stderr)
    write_model(out, tensors, m, source=os.path.abspath(hf_dir), overwrite=overwrite)


OVERWRITE_HELP = (
    "replace the output directory if this converter wrote it earlier (it holds "
    ".megatron_lite_convert.json): the new output is written beside it and swapped in "
    "atomically, the old one removed after. Never replaces anything else, nor writes inside "
    "a run's checkpoint folder"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser(
        "dcp-to-hf",
        help="our checkpoint -> HF Llama/Qwen3/Mixtral/Qwen3-MoE/Qwen2-MoE/DeepSeek-V3 directory",
    )
    a.add_argument("checkpoint", help="step_<N> directory (or a folder with `latest`)")
    a.add_argument("out_dir", help="directory to create (new or empty)")
    a.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    b = sub.add_parser(
        "hf-to-dcp",
        help="HF Llama/Qwen3/Mixtral/Qwen3-MoE/Qwen2-MoE/DeepSeek-V3 directory -> model-only "
        "checkpoint",
    )
    b.add_argument("hf_dir")
    b.add_argument("out", help="checkpoint directory to create (use with train.init_from)")
    b.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    b.add_argument(
        "--no-mtp",
        action="store_true",
        help="DeepSeek-V3: drop the multi-token prediction layer (layer num_hidden_layers) "
        "instead of importing it as model.mtp_num_layers=1",
    )
    args = parser.parse_args(argv)
    # a file-size limit: EFBIG (named below), not a kill (CPython ignores it at start-up; an
    # embedding interpreter may not)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        if args.cmd == "dcp-to-hf":
            dcp_to_hf(args.checkpoint, args.out_dir, getattr(torch, args.dtype), args.overwrite)
            print(f"wrote {args.out_dir}/model.safetensors and config.json")
        else:
            hf_to_dcp(args.hf_dir, args.out, args.overwrite, mtp=not args.no_mtp)
            print(f"wrote {args.out}; start training from it with train.init_from={args.out}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
