"""SentencePiece BPE tokenizer: training (deterministic, byte fallback) and a thin wrapper."""

from __future__ import annotations

import io
import os

import sentencepiece as spm

from megatron_lite.atomic import write_atomic
from megatron_lite.data.errors import DataFileError

# Enough lines for a stable vocabulary while keeping training well under a minute on 2 cores.
DEFAULT_INPUT_SENTENCE_SIZE = 300_000
TRAINING_SEED = 1234


class Tokenizer:
    """A trained SentencePiece model. Ids: unk 0, bos 1, eos 2; no padding id."""

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise DataFileError(
                f"{model_path}: tokenizer model does not exist. Fix: train one "
                f"with tools/train_tokenizer.py or correct data.tokenizer_model"
            )
        self.model_path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            raise DataFileError(
                f"{model_path}: not a SentencePiece model ({e}). Fix: train one "
                f"with tools/train_tokenizer.py"
            ) from None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once on all cores (same ids as `encode` on each)."""
        return self._sp.encode(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


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
