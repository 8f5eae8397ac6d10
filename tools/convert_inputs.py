"""Reading what tools/convert_checkpoint.py converts, each failure a CheckpointError naming the
file (exit 2): a Hugging Face directory (config.json, *.safetensors) and our checkpoint
directory. Nothing here writes."""

from __future__ import annotations

import glob
import json
import os

import torch

from megatron_lite.checkpoint.errors import CheckpointError

CONFIG_MAX_BYTES = 16 << 20  # a config.json is a few KB; a larger file is not one


def _fix_dir(what: str) -> str:
    return f"Fix: point at {what}"


def check_input_dir(path: str, what: str) -> None:
    """`path` exists and is a directory (it may be a link to one)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist. {_fix_dir(what)}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory. {_fix_dir(what)}")


def read_hf_config(hf_dir: str) -> tuple[dict, str]:
    """(the parsed config.json, its path); CheckpointError when it is missing, unreadable, too
    large, not UTF-8 or not JSON (its fields are checked by tools/hf_checks.py)."""
    check_input_dir(hf_dir, "a Hugging Face model directory (config.json + *.safetensors)")
    file = os.path.join(hf_dir, "config.json")
    try:
        if os.path.getsize(file) > CONFIG_MAX_BYTES:
            raise CheckpointError(
                f"{file} is larger than {CONFIG_MAX_BYTES >> 20} MiB: not a model config. "
                "Fix: use the model's config.json"
            )
        with open(file, "rb") as f:
            return json.loads(f.read().decode("utf-8")), file
    except FileNotFoundError:
        raise CheckpointError(
            f"{file} does not exist: {hf_dir} is not a Hugging Face model directory. "
            f"{_fix_dir('the directory that holds config.json and *.safetensors')}"
        ) from None
    except IsADirectoryError:
        raise CheckpointError(
            f"{file} is a directory, not a config file. Fix: replace it"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e.strerror}. Fix: check it") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested beyond parsing
        raise CheckpointError(
            f"{file} is not JSON ({str(e)[:200]}). Fix: use the model's original config.json"
        ) from None


def read_hf_tensors(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of the directory's *.safetensors files and {name: the file holding it};
    CheckpointError naming a file that is not safetensors (empty, truncated, a pickle, ...),
    cannot be read, or repeats a tensor of another file."""
    from safetensors import SafetensorError, safe_open

    tensors, where = {}, {}
    paths = sorted(glob.glob(os.path.join(glob.escape(hf_dir), "*.safetensors")))
    if not paths:
        raise CheckpointError(
            f"{hf_dir} has no *.safetensors files (pytorch_model.bin pickles are not read: "
            "they can run code). Fix: save the model with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
        )
    for path in paths:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name in where:
                        raise CheckpointError(
                            f"{path} repeats tensor {name} of {where[name]}: the directory "
                            "mixes two models' files. Fix: keep one model's files only"
                        )
                    tensors[name], where[name] = f.get_tensor(name), path
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            why = getattr(e, "strerror", None) or str(e)[:200] or type(e).__name__
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({why}): empty, truncated, or "
                "another format. Fix: download or export the model's weights again"
            ) from None
    return tensors, where
