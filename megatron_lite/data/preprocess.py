"""Text or JSON-lines files -> tokenized indexed dataset (.bin/.idx) with EOS after each document.

Document boundaries, per input file:
  - `*.jsonl` / `*.json`: one JSON object per line, the document is its `json_key` field;
  - other files, `split="file"`: the whole file is one document;
  - `split="line"`: every non-blank line is a document;
  - `split="blank_line"`: paragraphs separated by blank lines are documents.
Whitespace-only documents are skipped.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

from megatron_lite.data.errors import DataFileError
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megatron_lite.data.tokenizer import Tokenizer

SPLITS = ("file", "line", "blank_line")
JSON_SUFFIXES = (".jsonl", ".json")
# Texts are encoded in batches (on all cores) of about this many characters.
_BATCH_CHARS = 1 << 20


@dataclass
class PreprocessStats:
    prefix: str
    documents: int
    tokens: int  # including one EOS per document
    max_token_id: int


def preprocess(
    files: list[str],
    tokenizer: Tokenizer | str,
    output_prefix: str,
    split: str = "file",
    json_key: str = "text",
    append_eos: bool = True,
    progress: bool = True,
    workers: int = 1,
) -> PreprocessStats:
    """Tokenize `files` in order into the indexed dataset `output_prefix` (.bin/.idx).

    The dataset is written atomically (see IndexedDatasetBuilder): if anything fails, an existing
    dataset at `output_prefix` is left untouched. `progress` shows a tqdm bar over input bytes
    (on stderr). `workers` > 1 tokenizes batches of about 1 MiB of text in that many processes
    (an ordered imap: the output is byte-identical for any number of workers); 1 tokenizes in
    this process on all cores. Inputs without a single token raise DataFileError and write
    nothing.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {', '.join(SPLITS)}")
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    if isinstance(tokenizer, str):
        tokenizer = Tokenizer(tokenizer)
    for path in files:
        if not os.path.isfile(path):
            raise DataFileError(f"{path}: input file does not exist. Fix: correct the path")
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
    total_bytes = sum(os.path.getsize(p) for p in files)
    eos = [tokenizer.eos_id] if append_eos else []
    docs = tokens = 0
    with (
        _encoded_batches(_batches(files, split, json_key), tokenizer, workers) as encoded,
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
                + (f" and the JSON key {json_key!r}" if any(_is_json(p) for p in files) else "")
                + (" or the split mode" if split != "file" else "")
            )
        max_id = builder.max_token_id
    return PreprocessStats(output_prefix, docs, tokens, max_id)


@contextlib.contextmanager
def _encoded_batches(batches: Iterator, tokenizer: Tokenizer, workers: int):
    """Yields an iterator of (token ids per document, input bytes), in input order."""
    if workers == 1:
        yield ((tokenizer.encode_batch(texts), nbytes) for texts, nbytes in batches)
        return
    # spawn: safe whatever the parent has started (threads, torch); workers import only data/
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.model_path,)) as pool:
        yield pool.imap(_encode_in_worker, batches)


# The tokenizer of a preprocessing worker process (set once by the pool's initializer).
_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_path: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker_tokenizer = Tokenizer(model_path)


def _encode_in_worker(batch: tuple[list[str], int]) -> tuple[list[list[int]], int]:
    texts, nbytes = batch
    return _worker_tokenizer.encode_batch(texts, threads=1), nbytes


def _is_json(path: str) -> bool:
    return path.endswith(JSON_SUFFIXES)


def _batches(files: list[str], split: str, json_key: str) -> Iterator[tuple[list[str], int]]:
    """Group documents into batches: yields (texts, input bytes consumed since last batch)."""
    texts: list[str] = []
    chars = nbytes = 0
    for path in files:
        for text, size in iter_documents(path, split, json_key):
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


def iter_documents(path: str, split: str = "file", json_key: str = "text") -> Iterator[tuple]:
    """Yield (document text, input bytes it came from) for one file; see the module docstring."""
    with open(path, "rb") as f:
        if path.endswith(JSON_SUFFIXES):
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield _json_text(path, lineno, line, json_key), len(line)
                else:
                    yield "", len(line)
        elif split == "file":
            data = f.read()
            yield _decode(path, 1, data), len(data)
        elif split == "line":
            for lineno, line in enumerate(f, 1):
                yield _decode(path, lineno, line).rstrip("\r\n"), len(line)
        else:
            yield from _paragraphs(path, f)


def _paragraphs(path: str, f) -> Iterator[tuple[str, int]]:
    lines: list[str] = []
    size = 0
    for lineno, line in enumerate(f, 1):
        size += len(line)
        text = _decode(path, lineno, line)
        if text.strip():
            lines.append(text)
        elif lines:
            yield "".join(lines).rstrip("\r\n"), size
            lines, size = [], 0
    if lines or size:
        yield "".join(lines).rstrip("\r\n"), size


def _decode(path: str, lineno: int, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataFileError(
            f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start}). "
            f"Fix: convert the file to UTF-8, e.g. with iconv"
        ) from None


def _json_text(path: str, lineno: int, line: bytes, key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataFileError(
            f"{path}:{lineno}: not a JSON object ({e.msg}). Fix: one JSON "
            f"object per line (JSON lines)"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataFileError(
            f"{path}:{lineno}: no string field {key!r} (found: {keys}). Fix: "
            f"pass --json-key with the field that holds the text"
        )
    return record[key]
