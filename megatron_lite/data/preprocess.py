"""Input files -> tokenized indexed dataset (.bin/.idx) with EOS after each document.

The inputs (paths, glob patterns, saved Hugging Face dataset directories; see `readers` for the
formats) are read in the order given, each pattern's matches sorted by name. Document
boundaries: a JSON line, a Parquet or dataset row; in text files, per `split`:
  - `split="file"`: the whole file is one document;
  - `split="line"`: every non-blank line is a document;
  - `split="blank_line"`: paragraphs separated by blank lines are documents.
Whitespace-only documents are skipped.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

from megatron_lite.data.errors import DataFileError
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megatron_lite.data.readers import (
    check_dependency,
    detect_format,
    expand_inputs,
    input_size,
    iter_documents,
)
from megatron_lite.data.tokenizer import Tokenizer

SPLITS = ("file", "line", "blank_line")
# Texts are encoded in batches of about this many characters.
_BATCH_CHARS = 1 << 20
# With worker processes, at most this many batches per worker are read ahead of the writer.
_IN_FLIGHT_PER_WORKER = 2


@dataclass
class PreprocessStats:
    prefix: str
    documents: int
    tokens: int  # including one EOS per document
    max_token_id: int
    inputs: int = 0  # input files and dataset directories read
    input_bytes: int = 0


def preprocess(
    files: list[str],
    tokenizer: Tokenizer | str,
    output_prefix: str,
    split: str = "file",
    text_key: str = "text",
    append_eos: bool = True,
    progress: bool = True,
    workers: int = 1,
    input_format: str | None = None,
) -> PreprocessStats:
    """Tokenize `files` in order into the indexed dataset `output_prefix` (.bin/.idx).

    `files` are paths and glob patterns (see `readers.expand_inputs`); `input_format` forces one
    format for all of them instead of choosing by name (`readers.FORMATS`); `text_key` is the
    JSON field or the Parquet / dataset column holding the text. The dataset is written
    atomically (see IndexedDatasetBuilder): if anything fails, for instance a corrupt input
    (named with its line or row), nothing is written and an existing dataset at
    `output_prefix` is left untouched. `progress` shows a tqdm bar over input bytes (on
    stderr). `workers` > 1 tokenizes batches of about 1 MiB of text in that many processes,
    at most 2 per worker in flight, written in input order (the output is byte-identical for
    any number of workers); 1 tokenizes in this process on all cores. Inputs without a single
    token raise DataFileError and write nothing.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {', '.join(SPLITS)}")
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    if isinstance(tokenizer, str):
        tokenizer = Tokenizer(tokenizer)
    files = expand_inputs(files)
    formats = [detect_format(path, input_format) for path in files]
    # a missing optional package fails here, before any work, naming the first file that needs it
    for path, fmt in zip(files, formats, strict=True):
        check_dependency(path, fmt)
    if append_eos and tokenizer.eos_id < 0:
        raise DataFileError(
            f"{tokenizer.model_path}: has no end-of-document token (eos id {tokenizer.eos_id}), "
            f"so documents cannot be separated. Fix: a tokenizer with an EOS (those of "
            f"tools/train_tokenizer.py have one), or --no-eos to write documents back to back"
        )
    if tokenizer.vocab_size > 2**31:
        raise DataFileError(
            f"{tokenizer.model_path}: ids up to {tokenizer.vocab_size - 1} do not fit the "
            f"dataset's widest token type (int32). Fix: a tokenizer with ids below 2^31"
        )
    total_bytes = sum(input_size(p, f) for p, f in zip(files, formats, strict=True))
    eos = [tokenizer.eos_id] if append_eos else []
    docs = tokens = 0
    batches = _batches(files, formats, split, text_key)
    with (
        _encoded_batches(batches, tokenizer, workers) as encoded,
        IndexedDatasetBuilder(output_prefix, best_dtype(tokenizer.vocab_size)) as builder,
        tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for batch, nbytes in encoded:
            for ids in batch:
                builder.add_document(ids + eos)
                tokens += len(ids) + len(eos)
            docs += len(batch)
            bar.update(nbytes)
        if tokens == 0:  # raised inside the builder, which then discards its temporaries
            raise DataFileError(
                f"{', '.join(files)}: no tokens to write ({docs} documents; empty or "
                f"whitespace-only input), so no dataset was written to {output_prefix}. Fix: "
                f"check the input files"
                + (f" and the text key {text_key!r}" if set(formats) - {"text"} else "")
                + (" or the split mode" if split != "file" else "")
            )
        max_id = builder.max_token_id
    return PreprocessStats(output_prefix, docs, tokens, max_id, len(files), total_bytes)


@contextlib.contextmanager
def _encoded_batches(batches: Iterator, tokenizer: Tokenizer, workers: int):
    """Yields an iterator of (token ids per document, input bytes), in input order."""
    if workers == 1:
        yield ((tokenizer.encode_batch(texts), nbytes) for texts, nbytes in batches)
        return
    # spawn: safe whatever the parent has started (threads, torch); workers import only data/
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.model_path,)) as pool:
        yield _in_order(pool, batches, _IN_FLIGHT_PER_WORKER * workers)


def _in_order(pool, batches: Iterator, depth: int) -> Iterator:
    """The pool's results in input order with at most `depth` batches submitted and not yet
    taken: pool.imap would read ahead as fast as the input allows, holding the corpus in memory
    whenever the reader outruns the tokenizers."""
    pending: collections.deque = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_in_worker, (batch,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# The tokenizer of a preprocessing worker process (set once by the pool's initializer).
_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_path: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker_tokenizer = Tokenizer(model_path)


def _encode_in_worker(batch: tuple[list[str], int]) -> tuple[list[list[int]], int]:
    texts, nbytes = batch
    return _worker_tokenizer.encode_batch(texts, threads=1), nbytes


def _batches(
    files: list[str], formats: list[str], split: str, text_key: str
) -> Iterator[tuple[list[str], int]]:
    """Group documents into batches: yields (texts, input bytes consumed since last batch)."""
    texts: list[str] = []
    chars = nbytes = 0
    for path, fmt in zip(files, formats, strict=True):
        for text, size in iter_documents(path, fmt, split, text_key):
            nbytes += size
            if not text.strip():
                continue
            texts.append(text)
            chars += len(text)
            if chars >= _BATCH_CHARS:
                yield texts, nbytes
                texts, chars, nbytes = [], 0, 0
    if texts or nbytes:
        yield texts, nbytes
