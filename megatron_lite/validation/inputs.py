"""Rules on what a run reads and writes: checkpoints to save, resume or initialise from, and the
training data and tokenizer."""

from __future__ import annotations

import os

from megatron_lite.config import Config, DataConfig, TrainConfig
from megatron_lite.resolve import eod_token_id, split_weights, tokenizer_vocab_size, uses_documents
from megatron_lite.validation.rules import _choice, _rule, _timeout


def _validate_checkpointing(t: TrainConfig) -> None:
    _rule(
        t.save_interval >= 0,
        "train.save_interval",
        t.save_interval,
        "must be >= 0",
        "use 0 (no checkpoints) or a step count, e.g. 100",
    )
    _rule(
        t.keep_checkpoints >= 1,
        "train.keep_checkpoints",
        t.keep_checkpoints,
        "must be >= 1",
        "keep at least the newest checkpoint, e.g. 2",
    )
    _rule(
        t.resume in ("auto", "none") or os.path.exists(t.resume),
        "train.resume",
        t.resume,
        "must be auto, none or an existing checkpoint path",
        "use auto (newest checkpoint in train.ckpt_dir) or a step_<N> directory",
    )
    _rule(
        t.resume in ("auto", "none") or os.path.isdir(t.resume),
        "train.resume",
        t.resume,
        "is a file, not a checkpoint directory",
        "give the step_<N> directory that holds the checkpoint, or auto",
    )
    if t.init_from is not None:
        _rule(
            os.path.isdir(t.init_from),
            "train.init_from",
            t.init_from,
            "must be an existing checkpoint directory",
            "convert Hugging Face weights with tools/convert_checkpoint.py hf-to-dcp first",
        )
        _rule(
            not os.path.isfile(os.path.join(t.init_from, "config.json")),
            "train.init_from",
            t.init_from,
            "is a Hugging Face model directory, not a checkpoint",
            "convert it: python tools/convert_checkpoint.py hf-to-dcp <hf_dir> <ckpt_dir>",
        )
    _timeout("train.async_save_timeout_s", t.async_save_timeout_s, "use e.g. 3600 (an hour)")


def _validate_data(cfg: Config) -> None:
    """A data source exists: mock tokens, a built-in corpus, or indexed files on disk. Files
    named are checked even where mock data leaves them unused (config_warnings says so)."""
    m, d = cfg.model, cfg.data
    if d.mock:
        _rule(
            m.vocab_size is not None,
            "model.vocab_size",
            m.vocab_size,
            "mock data needs an explicit vocabulary size",
            "set model.vocab_size, e.g. 512",
        )
    else:
        _rule(
            bool(d.paths) or d.corpus is not None,
            "data.paths",
            d.paths,
            "no training data: give indexed dataset prefixes, a built-in corpus or mock data",
            "set data.paths=[prefix], data.corpus=shakespeare or data.mock=true",
        )
        _rule(
            not (d.paths and d.corpus is not None),
            "data.corpus",
            d.corpus,
            f"is set together with data.paths={d.paths}: one source of training data",
            "use one of them (data.corpus=null to train on data.paths)",
        )
    if d.corpus is not None:
        _choice("data.corpus", d.corpus, ("shakespeare",))
    if d.weights is not None:
        _rule(
            len(d.weights) == len(d.paths),
            "data.weights",
            d.weights,
            f"needs one weight per path ({len(d.paths)} paths)",
            "list one weight per path",
        )
    for prefix in d.paths:
        _validate_prefix(prefix)
    if d.tokenizer_model is not None:
        _validate_tokenizer_file(d.tokenizer_model)


def _validate_tokenizer_file(path: str) -> None:
    _rule(
        os.path.isfile(path),
        "data.tokenizer_model",
        path,
        "file does not exist" if not os.path.isdir(path) else "is a directory",
        "train one with tools/train_tokenizer.py, or give the path of its sentencepiece "
        ".model or Hugging Face tokenizer.json file",
    )
    _rule(
        os.access(path, os.R_OK),
        "data.tokenizer_model",
        path,
        "is not readable by this user",
        "fix its permissions",
    )


def _validate_prefix(prefix: str, key: str = "data.paths") -> None:
    """One entry of `key` (data.paths, data.valid_paths): a prefix (no extension) whose .bin
    and .idx are readable files."""
    stem, ext = os.path.splitext(prefix)
    _rule(
        ext not in (".bin", ".idx") or os.path.isfile(prefix + ".bin"),
        key,
        prefix,
        f"entries are prefixes without the {ext} extension",
        f"use {key}=[{stem}]",
    )
    for path in (prefix + ".bin", prefix + ".idx"):
        _rule(
            not os.path.isdir(path),
            key,
            prefix,
            f"{path} is a directory, not a data file",
            "give the prefix of a .bin/.idx pair written by tools/preprocess_data.py",
        )
        _rule(
            os.path.isfile(path),
            key,
            prefix,
            f"file {path} does not exist",
            "run tools/preprocess_data.py to create it or correct the prefix",
        )
        _rule(
            os.access(path, os.R_OK),
            key,
            prefix,
            f"file {path} is not readable by this user",
            "fix its permissions or copy the dataset",
        )


def _validate_eval(cfg: Config) -> None:
    """Validation loss settings: an interval, a batch count, and validation data to use."""
    d, t = cfg.data, cfg.train
    _rule(
        t.eval_interval >= 0,
        "train.eval_interval",
        t.eval_interval,
        "must be >= 0 (0 = never)",
        "use e.g. 100",
    )
    _rule(t.eval_iters >= 1, "train.eval_iters", t.eval_iters, "must be >= 1", "use e.g. 10")
    weights = split_weights(d.split) if d.split is not None else None
    fix = 'use e.g. data.split="969,30,1"'
    if d.split is not None:
        _rule(
            weights is not None,
            "data.split",
            d.split,
            "must be 1 to 3 non-negative weights (train,valid,test) with a positive sum",
            fix,
        )
        _rule(
            not d.valid_paths,
            "data.split",
            d.split,
            "is set with data.valid_paths (validation data comes from one of them)",
            "set data.split=null to validate on data.valid_paths, or data.valid_paths=[] to "
            "validate on a part of data.paths",
        )
    for prefix in d.valid_paths:
        _validate_prefix(prefix, "data.valid_paths")
    if t.eval_interval > 0 and not d.mock:
        _rule(
            bool(d.valid_paths) or bool(weights and weights[1] > 0),
            "train.eval_interval",
            t.eval_interval,
            "needs validation data: data.valid_paths, or a data.split with a validation part",
            'set data.split="969,30,1" (or data.valid_paths), or train.eval_interval=0',
        )


def check_token_ids(d: DataConfig, vocab: int | None, source: str) -> None:
    """Every token-id key (data.eod_token_id) inside the vocabulary `vocab` of `source` (the
    model's, the tokenizer's or the data's; None: not known yet, build_dataset checks it again
    with the data's): an id the data never holds would make document masking do nothing."""
    if d.eod_token_id is None:
        return
    _rule(
        d.eod_token_id >= 0 and (vocab is None or d.eod_token_id < vocab),
        "data.eod_token_id",
        d.eod_token_id,
        f"must be a token id in [0, {vocab if vocab is not None else 'vocab_size'})"
        + (f" ({source})" if vocab is not None else ""),
        "set it to the tokenizer's end-of-document id (or null to use its eos)",
    )


def _validate_documents(cfg: Config) -> None:
    """Document masking (data.reset_attention_mask, reset_position_ids, eod_mask_loss) needs an
    end-of-document id inside the vocabulary, and an attention backend that takes a mask."""
    d, m = cfg.data, cfg.model
    tokenizer = tokenizer_vocab_size(d)  # None: only the data can tell (build_dataset)
    if tokenizer is not None and (m.vocab_size is None or tokenizer < m.vocab_size):
        check_token_ids(d, tokenizer, "the tokenizer's vocabulary")
    else:
        check_token_ids(d, m.vocab_size, "model.vocab_size")
    if not uses_documents(d):
        return
    flags = [k for k in ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")
             if getattr(d, k)]  # fmt: skip
    _rule(
        eod_token_id(d) is not None,
        "data.eod_token_id",
        d.eod_token_id,
        f"data.{flags[0]} needs an end-of-document id and no tokenizer names one (mock data "
        "or data.paths without data.tokenizer_model)",
        "set data.eod_token_id to the id that ends each document",
    )
    _rule(
        not (d.reset_attention_mask and m.attention_backend == "te"),
        "model.attention_backend",
        m.attention_backend,
        "data.reset_attention_mask needs a per-document mask, which the te backend does not take",
        "use model.attention_backend=sdpa or flash",
    )
