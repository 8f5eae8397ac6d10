"""Tokenizers: SentencePiece BPE training (deterministic, byte fallback) and a thin wrapper over
a SentencePiece `.model` or a Hugging Face `tokenizer.json`."""

from __future__ import annotations

import io
import json
import os

import sentencepiece as spm

from megatron_lite.atomic import write_atomic
from megatron_lite.data.errors import DataFileError

# Enough lines for a stable vocabulary while keeping training well under a minute on 2 cores.
DEFAULT_INPUT_SENTENCE_SIZE = 300_000
TRAINING_SEED = 1234
TRAINED_EOS_ID = 2  # train_tokenizer's SentencePiece models: unk 0, bos 1, eos 2


# EOS names of the common Hugging Face tokenizers (Llama-3, GPT-2/Qwen, Llama-2/Mistral, Gemma),
# tried in order when no tokenizer_config.json beside the tokenizer.json names its eos_token.
HF_EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class Tokenizer:
    """A trained tokenizer: a SentencePiece `.model` or a Hugging Face `tokenizer.json`.

    SentencePiece ids: unk 0, bos 1, eos 2; no padding id. A `tokenizer.json` is read with the
    `tokenizers` package; its EOS is the `eos_token` of a `tokenizer_config.json` in the same
    folder, else the first of HF_EOS_TOKENS it knows. Either kind encodes without adding special
    tokens (no BOS): documents are raw text, and preprocessing appends the EOS.
    """

    def __init__(self, model_path: str):
        if os.path.isdir(model_path):
            inside = [n for n in ("tokenizer.json", "tokenizer.model") if
                      os.path.isfile(os.path.join(model_path, n))]  # fmt: skip
            hint = f"give {os.path.join(model_path, inside[0])}" if inside else "give the file"
            raise DataFileError(
                f"{model_path}: is a directory, not a tokenizer file. Fix: {hint} (a "
                f"SentencePiece .model or a Hugging Face tokenizer.json)"
            )
        if not os.path.isfile(model_path):
            raise DataFileError(
                f"{model_path}: tokenizer model does not exist. Fix: train one "
                f"with tools/train_tokenizer.py or correct data.tokenizer_model"
            )
        self.model_path = model_path
        self.is_hf = model_path.endswith(".json")
        if self.is_hf:
            self._hf = _load_hf(model_path)
            # the ids may have gaps: the embedding needs the largest + 1, not the count
            self._hf_vocab = 1 + max(
                self._hf.get_vocab(with_added_tokens=True).values(), default=-1
            )
            if self._hf_vocab == 0:
                raise DataFileError(
                    f"{model_path}: has an empty vocabulary. Fix: give the tokenizer.json of "
                    f"a trained tokenizer"
                )
            self._eos = _hf_eos_id(self._hf, model_path)
            return
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            raise DataFileError(
                f"{model_path}: not a SentencePiece model ({e}). Fix: train one "
                f"with tools/train_tokenizer.py, or give a Hugging Face tokenizer.json"
            ) from None
        self._eos = self._sp.eos_id()

    @property
    def vocab_size(self) -> int:
        """The ids' range: largest id + 1 (a tokenizer.json's ids may have gaps)."""
        if self.is_hf:
            return self._hf_vocab
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        if self.is_hf:
            return self._hf.encode(text, add_special_tokens=False).ids
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], threads: int | None = None) -> list[list[int]]:
        """Encode many texts at once (same ids as `encode` on each), on `threads` threads
        (default: all cores)."""
        if self.is_hf:
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        return self._sp.encode(texts, num_threads=threads or os.cpu_count() or 1)

    def decode(self, ids) -> str:
        if self.is_hf:
            return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)
        return self._sp.decode([int(i) for i in ids])


def _load_hf(path: str):
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise DataFileError(
            f"{path}: a Hugging Face tokenizer.json needs the `tokenizers` package. Fix: "
            f"pip install tokenizers (it is in megatron_lite's install_requires)"
        ) from None
    try:
        return HFTokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception on malformed files
        raise DataFileError(
            f"{path}: not a Hugging Face tokenizer.json ({e}). Fix: give the tokenizer.json of "
            f"a Hugging Face model, or a SentencePiece .model"
        ) from None


def _hf_eos_id(tok, path: str) -> int:
    """The EOS id: tokenizer_config.json's eos_token beside `path` (a config that cannot be
    read, or names a token the vocabulary lacks, is an error), else a known EOS name."""
    names = list(HF_EOS_TOKENS)
    config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    eos = _config_eos(config) if os.path.lexists(config) else None
    if eos is not None:
        token_id = tok.token_to_id(eos)
        if token_id is None:
            known = [n for n in names if tok.token_to_id(n) is not None]
            raise DataFileError(
                f"{config}: eos_token {eos!r} is not in the vocabulary of {path}. Fix: use the "
                f"tokenizer_config.json that came with this tokenizer.json, or set eos_token to "
                + (f"one of its tokens, e.g. {known[0]!r}" if known else "one of its tokens")
            )
        return token_id
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise DataFileError(
        f"{path}: no end-of-document token: none of {', '.join(names)} is in its vocabulary. "
        f'Fix: put a tokenizer_config.json with an "eos_token" beside it, or add one of '
        f"those tokens when training the tokenizer"
    )


def _config_eos(config: str) -> str | None:
    """A tokenizer_config.json's eos_token (a string, or {"content": ...}; None when it names
    none); DataFileError naming the file when it is not a readable JSON object of that shape."""
    fix = 'Fix: repair it (a JSON object with "eos_token": "<token>"), or remove it to use ' + (
        f"the first of {', '.join(HF_EOS_TOKENS)} in the vocabulary"
    )
    try:
        with open(config, encoding="utf-8") as f:
            record = json.load(f)
    except IsADirectoryError:
        raise DataFileError(f"{config}: is a directory, not a JSON file. {fix}") from None
    except OSError as e:
        raise DataFileError(f"{config}: cannot be read ({e.strerror}). {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DataFileError(f"{config}: is not valid JSON ({e}). {fix}") from None
    if not isinstance(record, dict):
        raise DataFileError(f"{config}: holds a {type(record).__name__}, not an object. {fix}")
    eos = record.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not (isinstance(eos, str) and eos):
        raise DataFileError(f"{config}: eos_token={eos!r} is not a token string. {fix}")
    return eos


def train_tokenizer(
    input_files: list[str],
    model_prefix: str,
    vocab_size: int,
    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE,
) -> str:
    """Train a byte-fallback BPE model on text files (one sentence per line); return its path.

    Writes `<model_prefix>.model` (atomically: temporary file, then rename) and a readable
    `<model_prefix>.vocab`. The same inputs give a byte-identical model: the sampling seed is
    fixed and the model is serialised in memory instead of embedding a temporary path. Text is
    kept verbatim (no normalisation, whitespace and newlines survive a round trip), digits are
    split, and unknown characters fall back to byte tokens.
    """
    for path in input_files:
        if not os.path.isfile(path):
            raise DataFileError(
                f"{path}: tokenizer training input does not exist. Fix: pass existing text files"
            )
    model = io.BytesIO()
    spm.set_random_generator_seed(TRAINING_SEED)
    try:
        spm.SentencePieceTrainer.train(
            input=list(input_files),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataFileError(
            f"training a {vocab_size}-token tokenizer on {len(input_files)} "
            f"file(s) ({', '.join(input_files[:3])}...) failed: {e}. Fix: lower "
            f"the vocabulary size or give more text"
        ) from None
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    model_path = model_prefix + ".model"
    write_atomic(model_path, model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = (f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    write_atomic(model_prefix + ".vocab", "".join(pieces).encode())
    return model_path
