"""Where generation's weights come from, resolved and checked before any process group exists:
a training run (`--run DIR`: its newest checkpoint, and the tokenizer its config records), a
checkpoint directory (`--checkpoint DIR`), or a Hugging Face Llama / Qwen3 / Mixtral /
Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 directory (`--hf DIR`, converted in memory by
tools/hf_families.py, the converter's own mapping; DeepSeek-V3's MTP layer dropped). Every
failure is a `GenerateError` naming the flag, the file, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from megatron_lite.checkpoint import files
from megatron_lite.checkpoint.errors import CheckpointError
from megatron_lite.config import ConfigError, ModelConfig, load_config

__all__ = ["GenerateError", "Source", "open_source"]


class GenerateError(ValueError):
    """Bad generation input; the message is meant for the user as-is (exit 2)."""


@dataclasses.dataclass
class Source:
    """The weights to generate from: their `model.*` keys, where they are (`checkpoint`: a
    checkpoint directory the resharding loader reads; `tensors`: HF weights converted to our
    logical tensors), the tokenizer recorded with them (None: none recorded), and `context`,
    the longest sequence the model takes (prompt + new tokens)."""

    flag: str  # "--run DIR", "--checkpoint DIR" or "--hf DIR", as messages name it
    model: ModelConfig
    checkpoint: str | None = None
    tensors: dict | None = None
    tokenizer: str | None = None
    context: int = 0
    hf_tokenizer_padding: bool = False  # HF embeddings may have rows no token uses


def model_config(keys: dict, where: str) -> ModelConfig:
    """The recorded `model.*` keys over ModelConfig's defaults; a key this version does not
    know is an error (it may change what the weights compute)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise GenerateError(
            f"{where}: model keys {unknown} are unknown to this megatron_lite. Fix: generate "
            "with the version that wrote the checkpoint"
        )
    m = dataclasses.replace(ModelConfig(), **keys)
    if m.vocab_size is None:
        raise GenerateError(
            f"{where}: model.vocab_size is null, so the embedding's size is unknown. Fix: point "
            "at a checkpoint a training run (or tools/convert_checkpoint.py) wrote"
        )
    return m


def context_length(m: ModelConfig) -> int:
    """The longest sequence the model takes: its learned position table's rows, else the
    sequence length it was trained at (RoPE runs past it, but nothing trained it there)."""
    return m.max_position_embeddings or m.seq_length


def _checkpoint_source(flag: str, path: str) -> Source:
    meta = files.read_metadata(path)
    config = meta.get("config") or {}
    where = os.path.join(path, files.METADATA)
    m = model_config(config.get("model") or {}, where)
    return Source(flag, m, checkpoint=path, tokenizer=recorded_tokenizer(config.get("data")),
                  context=context_length(m))  # fmt: skip


def recorded_tokenizer(data: dict | None) -> str | None:
    """The tokenizer a run's data config trained with: data.tokenizer_model, or the built-in
    corpus' (prepared again, identically, if its cache was removed); None for mock data or a
    converted checkpoint, which records no data section."""
    if not data or data.get("mock"):
        return None
    if data.get("tokenizer_model"):
        return data["tokenizer_model"]
    if data.get("corpus"):
        from megatron_lite.data.corpus import prepare_corpus

        return prepare_corpus(data["corpus"], data["cache_dir"], data["tokenizer_vocab_size"])[1]
    return None


def run_source(run_dir: str) -> Source:
    """--run DIR: the newest committed checkpoint of the run whose config.yaml DIR holds."""
    flag = f"--run {run_dir}"
    config_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_file):
        raise GenerateError(
            f"{flag}: {config_file} does not exist, so {run_dir} is not a training run's "
            "directory (train.out_dir). Fix: give the directory a run wrote, or --checkpoint "
            "DIR for a checkpoint directory"
        )
    try:
        cfg = load_config(config_file)
    except ConfigError as e:
        raise GenerateError(f"{flag}: {e}") from None
    from megatron_lite.checkpoint.run_dir import ckpt_dir_of

    cfg.train.out_dir = run_dir  # the run may have been trained from another directory
    ckpt_dir = ckpt_dir_of(cfg)
    candidates = files.auto_candidates(ckpt_dir)
    if not candidates:
        raise GenerateError(
            f"{flag}: no checkpoint in {ckpt_dir}: the run saved none (train.save_interval="
            f"{cfg.train.save_interval}; 0 never saves). Fix: train it with "
            "train.save_interval=N (a checkpoint every N steps and after the last), then run "
            "this again"
        )
    try:
        return _checkpoint_source(flag, candidates[0])
    except CheckpointError as e:
        raise GenerateError(f"{flag}: {e}") from None


def checkpoint_source(path: str) -> Source:
    """--checkpoint DIR: a step_<N> directory, or a checkpoint folder (its `latest`)."""
    flag = f"--checkpoint {path}"
    if not os.path.isdir(path):
        raise GenerateError(
            f"{flag}: not a directory. Fix: give a step_<N> checkpoint directory, or the "
            "checkpoints folder that holds them"
        )
    try:
        return _checkpoint_source(flag, files.resolve(path))
    except CheckpointError as e:
        raise GenerateError(f"{flag}: {e}") from None


def _tools():
    """tools/ of this checkout on the import path (the HF converter lives there)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isfile(os.path.join(root, "tools", "hf_families.py")):
        raise GenerateError(
            "--hf needs tools/hf_families.py, the converter's mapping, which a megatron_lite "
            f"checkout has beside megatron_lite/ ({root} has none). Fix: run from a checkout "
            "(pip install -e .), or convert first with tools/convert_checkpoint.py hf-to-dcp "
            "and use --checkpoint"
        )
    if root not in sys.path:
        sys.path.append(root)


def hf_source(hf_dir: str) -> Source:
    """--hf DIR: config.json and *.safetensors converted in memory (the mapping and checks of
    tools/convert_checkpoint.py hf-to-dcp); tokenizer.json (or tokenizer.model) beside them."""
    flag = f"--hf {hf_dir}"
    _tools()
    from tools.convert_inputs import read_hf_config, read_hf_tensors
    from tools.hf_deepseek import dequantize_fp8, settle_mtp
    from tools.hf_families import from_hf_config, from_hf_tensors

    try:
        config, file = read_hf_config(hf_dir)
        keys = from_hf_config(config, file)
        hf, where = read_hf_tensors(hf_dir)
        hf = dequantize_fp8(config, hf, file, lambda name: f" ({where.get(name, hf_dir)})")
        keys, hf, _ = settle_mtp(keys, hf, keep=False)  # DeepSeek-V3's MTP layer: not decoded
        tensors = from_hf_tensors(keys, hf, lambda name: f" ({where.get(name, hf_dir)})")
    except CheckpointError as e:
        raise GenerateError(f"{flag}: {e}") from None
    m = model_config(keys, file)
    # HF Llama positions go up to max_position_embeddings: the context, with no learned table
    if m.max_position_embeddings:
        m.seq_length = m.max_position_embeddings
    names = ("tokenizer.json", "tokenizer.model")
    tokenizer = next((os.path.join(hf_dir, n) for n in names if
                      os.path.isfile(os.path.join(hf_dir, n))), None)  # fmt: skip
    return Source(flag, m, tensors=tensors, tokenizer=tokenizer, context=context_length(m),
                  hf_tokenizer_padding=True)  # fmt: skip


def open_source(run: str | None, checkpoint: str | None, hf: str | None) -> Source:
    """The one source given (argparse makes them exclusive)."""
    if run is not None:
        return run_source(run)
    if checkpoint is not None:
        return checkpoint_source(checkpoint)
    return hf_source(hf)
