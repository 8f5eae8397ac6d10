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
        if not os.path.isfile(model_path):
            raise DataFileError(
                f"{model_path}: tokenizer model does not exist. Fix: train one "
                f"with tools/train_tokenizer.py or correct data.tokenizer_model"
            )
        self.model_path = model_path
        self.is_hf = model_path.endswith(".json")
        if self.is_hf:
            self._hf = _load_hf(model_path)
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
        if self.is_hf:
            return self._hf.get_vocab_size(with_added_tokens=True)
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
    """The EOS id: tokenizer_config.json's eos_token beside `path`, else a known EOS name."""
    names = list(HF_EOS_TOKENS)
    config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise DataFileError(
        f"{path}: no end-of-document token: none of {', '.join(names)} is in its vocabulary. "
        f'Fix: put a tokenizer_config.json with an "eos_token" beside it, or add one of '
        f"those tokens when training the tokenizer"
    )


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
