"""The input formats of tools/preprocess_data.py: which format a path is, and its documents.

    text       any other file: one document per file, per line or per blank-line paragraph
    jsonl      *.jsonl, *.json: one JSON object per line, the document is its `key` field
    jsonl.gz   *.jsonl.gz, *.json.gz: the same, gzip-compressed (streamed)
    jsonl.zst  *.jsonl.zst, *.json.zst: the same, zstd-compressed (streamed; needs zstandard)
    parquet    *.parquet: the string column `key` (needs pyarrow)
    hf         a directory written by `datasets.Dataset.save_to_disk`: the column `key` of its
               Arrow files in the order its state.json lists them (needs pyarrow, not datasets)

Memory is bounded whatever the file size: compressed files are decompressed 64 KiB of input at a
time, Parquet is read PARQUET_BATCH_ROWS rows of one column at a time through a READ_BUFFER
stream (never a whole row group: writers make row groups of up to 1M rows, gigabytes of text),
and an HF dataset's Arrow files one record batch at a time (not memory-mapped, so the pages read
do not stay resident). A reader yields (text, input bytes consumed) so progress counts file bytes.
A malformed file or record raises DataFileError naming the file and the line (JSON lines, from 1
as editors count) or the row (Parquet and HF datasets, from 0 as pyarrow and pandas count).
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from collections.abc import Iterator

from megatron_lite.data.errors import DataFileError

FORMATS = ("text", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf")
_SUFFIXES = {
    "jsonl.gz": (".jsonl.gz", ".json.gz"),
    "jsonl.zst": (".jsonl.zst", ".json.zst"),
    "jsonl": (".jsonl", ".json"),
    "parquet": (".parquet",),
}
# Compressed files of a kind we do not read: refused by name rather than decoded as garbage text.
_OTHER_COMPRESSED = (".gz", ".zst", ".zstd", ".bz2", ".xz", ".lz4")
# format -> (what it is called in messages, the module it needs beyond the core install)
_NEEDS = {
    "jsonl.zst": ("zstd-compressed JSON lines", "zstandard"),
    "parquet": ("Parquet", "pyarrow"),
    "hf": ("a saved Hugging Face dataset", "pyarrow"),
}
EXTRA_FIX = 'pip install -e ".[data]"'
PARQUET_BATCH_ROWS = 1024  # rows of the text column decoded at a time
READ_BUFFER = 1 << 20  # Parquet column chunks are streamed through a buffer of this size
_COMPRESSED_CHUNK = 1 << 16  # compressed bytes decompressed at a time


def expand_inputs(args: list[str]) -> list[str]:
    """The input paths of `args`, in order: an existing path as given, anything else as a glob
    pattern (`**` spans directories) whose matches come sorted by name (code point order, the
    same on every machine). A pattern without matches and an input listed twice are errors."""
    paths: list[str] = []
    for arg in args:
        if os.path.exists(arg) or not glob.has_magic(arg):
            paths.append(arg)
            continue
        matches = sorted(glob.glob(arg, recursive=True))
        if not matches:
            raise DataFileError(
                f"--input {arg!r}: the pattern matches no file. Fix: correct the pattern (quote "
                f"it so that this tool, not the shell, expands it)"
            )
        paths.extend(matches)
    seen: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            raise DataFileError(
                f"{path}: given twice (as {seen[real]!r} and {path!r}), so its documents would be "
                f"written twice. Fix: list each input once (blend datasets with data.weights)"
            )
        seen[real] = path
    return paths


def detect_format(path: str, forced: str | None = None) -> str:
    """The format of `path` (see the module docstring), or `forced` after checking it fits."""
    if forced is not None and forced not in FORMATS:
        raise ValueError(f"input format {forced!r} must be one of {', '.join(FORMATS)}")
    if os.path.isdir(path):
        if forced not in (None, "hf"):
            raise DataFileError(
                f"{path}: is a directory, not a {forced} file. Fix: give its files, e.g. "
                f"'{os.path.join(path, '*')}'"
            )
        if os.path.isfile(os.path.join(path, "state.json")):
            return "hf"
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            raise DataFileError(
                f"{path}: is a DatasetDict (a dataset_dict.json with several splits), not one "
                f"dataset. Fix: give one split's directory, e.g. {os.path.join(path, 'train')}"
            )
        raise DataFileError(
            f"{path}: is a directory but not a dataset saved with datasets' save_to_disk (no "
            f"state.json in it). Fix: give the files, e.g. '{os.path.join(path, '*.parquet')}'"
        )
    if not os.path.isfile(path):
        raise DataFileError(f"{path}: input file does not exist. Fix: correct the path")
    if forced == "hf":
        raise DataFileError(
            f"{path}: --input-format hf reads a directory written by save_to_disk, and this is "
            f"a file. Fix: give the dataset's directory"
        )
    if forced is not None:
        return forced
    name = path.lower()
    for fmt, suffixes in _SUFFIXES.items():
        if name.endswith(suffixes):
            return fmt
    if name.endswith(_OTHER_COMPRESSED):
        raise DataFileError(
            f"{path}: a compressed file of a kind this tool does not read as text. Fix: "
            f"decompress it, or if it holds JSON lines, name it *.jsonl.gz / *.jsonl.zst or "
            f"pass --input-format jsonl.gz / jsonl.zst"
        )
    return "text"


def check_dependency(path: str, fmt: str) -> None:
    """DataFileError if `fmt` needs an optional package that is not installed."""
    if fmt not in _NEEDS:
        return
    what, module = _NEEDS[fmt]
    try:
        __import__(module)
    except ImportError:
        raise DataFileError(
            f"{path}: reading {what} needs the optional package {module}, which is not "
            f"installed. Fix: {EXTRA_FIX} (the [data] extra: pyarrow, zstandard)"
        ) from None


def input_size(path: str, fmt: str) -> int:
    """Bytes the readers will count for `path` (an HF dataset: its Arrow files)."""
    if fmt == "hf":
        return sum(os.path.getsize(p) for p in _hf_files(path))
    return os.path.getsize(path)


def iter_documents(path: str, fmt: str, split: str = "file", key: str = "text") -> Iterator:
    """Yield (document text, input bytes consumed) for one input; see the module docstring.
    Empty and whitespace-only documents are yielded too (the caller skips them)."""
    if fmt == "text":
        yield from _text_documents(path, split)
    elif fmt == "jsonl":
        with open(path, "rb") as f:
            yield from _json_documents(path, ((line, len(line)) for line in f), key)
    elif fmt in ("jsonl.gz", "jsonl.zst"):
        yield from _json_documents(path, _decompressed_lines(path, fmt), key)
    elif fmt == "parquet":
        yield from _parquet_documents(path, key)
    elif fmt == "hf":
        yield from _hf_documents(path, key)
    else:
        raise ValueError(f"input format {fmt!r} must be one of {', '.join(FORMATS)}")


# ------------------------------------------------------------------ text and JSON lines
def _text_documents(path: str, split: str) -> Iterator[tuple[str, int]]:
    with open(path, "rb") as f:
        if split == "file":
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


def _json_documents(path: str, lines: Iterator[tuple[bytes, int]], key: str) -> Iterator:
    for lineno, (line, nbytes) in enumerate(lines, 1):
        if line.strip():
            yield _json_text(path, lineno, line, key), nbytes
        else:
            yield "", nbytes


def _json_text(path: str, lineno: int, line: bytes, key: str) -> str:
    try:
        record = json.loads(_decode(path, lineno, line))
    except json.JSONDecodeError as e:
        raise DataFileError(
            f"{path}:{lineno}: not a JSON object ({e.msg}). Fix: one JSON "
            f"object per line (JSON lines)"
        ) from None
    if isinstance(record, dict) and key in record and not isinstance(record[key], str):
        kind = "null" if record[key] is None else type(record[key]).__name__
        raise DataFileError(
            f"{path}:{lineno}: no string field {key!r} (it is {kind}). Fix: drop or fix the "
            f"records without text, or pass --text-column with the field that holds the text"
        )
    if not isinstance(record, dict) or key not in record:
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataFileError(
            f"{path}:{lineno}: no string field {key!r} (found: {keys}). Fix: "
            f"pass --text-column with the field that holds the text"
        )
    return record[key]


def _decompressed_lines(path: str, fmt: str) -> Iterator[tuple[bytes, int]]:
    """The lines of a gzip or zstd file (each with the compressed bytes read since the last
    line), split at b"\\n" as a plain file's lines are. Several members/frames are read one
    after another; a corrupt or truncated stream names the first line it could not give."""
    if fmt == "jsonl.gz":
        new, errors, kind = (lambda: zlib.decompressobj(wbits=31)), zlib.error, "gzip"
    else:
        import zstandard

        new, errors, kind = (
            zstandard.ZstdDecompressor().decompressobj,
            (zstandard.ZstdError,),
            "zstd",
        )
    lines, pending, unread, stream = 0, b"", 0, None
    with open(path, "rb") as f:
        while raw := f.read(_COMPRESSED_CHUNK):
            unread += len(raw)
            out = []
            try:
                while raw:
                    if stream is None:
                        if kind == "gzip" and not raw.strip(b"\0"):
                            break  # zero padding after the last member, which gzip allows
                        stream = new()
                    out.append(stream.decompress(raw))
                    raw, stream = (stream.unused_data, None) if stream.eof else (b"", stream)
            except errors as e:
                raise DataFileError(
                    f"{path}:{lines + 1}: the {kind} stream is corrupt from this line on ({e}; "
                    f"{lines} complete lines before it). Fix: re-download or re-compress the file"
                ) from None
            *complete, pending = (pending + b"".join(out)).split(b"\n")
            for line in complete:
                lines += 1
                yield line + b"\n", unread
                unread = 0
    if stream is not None:
        raise DataFileError(
            f"{path}:{lines + 1}: the {kind} stream ends in the middle (the file is truncated; "
            f"{lines} complete lines before it). Fix: re-download or re-compress the file"
        )
    if pending or unread:
        yield pending, unread


# ------------------------------------------------------------------ Parquet and HF datasets
def _parquet_documents(path: str, key: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, buffer_size=READ_BUFFER, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(
            f"{path}: not a readable Parquet file ({_reason(e)}). Fix: re-download or re-write "
            f"the file"
        ) from None
    _check_text_column(path, pf.schema_arrow, key)
    # the Parquet leaf column of the text (a nested column before it has several leaves)
    leaf = next(i for i in range(len(pf.schema)) if pf.schema.column(i).path == key)
    row = counted = 0
    for group in range(pf.num_row_groups):
        meta = pf.metadata.row_group(group)
        rows, size = meta.num_rows, meta.column(leaf).total_compressed_size
        done = shared = 0
        try:
            for batch in pf.iter_batches(
                batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[key], use_threads=False
            ):
                # progress: the row group's compressed bytes, shared out by rows
                nbytes = size * (done + batch.num_rows) // max(rows, 1) - shared
                shared += nbytes
                yield from _column_texts(path, "", batch.column(0), row + done, key, nbytes)
                done += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataFileError(
                f"{path}: row {row + done}: row group {group} (rows {row}..{row + rows - 1}) "
                f"cannot be read ({_reason(e)}). Fix: re-download or re-write the file"
            ) from None
        row, counted = row + rows, counted + size
    yield "", max(0, os.path.getsize(path) - counted)  # the footer and other columns: bar at 100%


def _hf_files(path: str) -> list[str]:
    """The Arrow files of a save_to_disk directory, in the order its state.json lists them."""
    state_path = os.path.join(path, "state.json")
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        files = [os.path.join(path, entry["filename"]) for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataFileError(
            f"{state_path}: not the state.json of datasets' save_to_disk (no list of "
            f"_data_files: {type(e).__name__} {e}). Fix: save the dataset again with "
            f"Dataset.save_to_disk"
        ) from None
    if state.get("_indices_data_files"):
        raise DataFileError(
            f"{state_path}: the dataset has an indices mapping (a selection not yet written "
            f"out). Fix: save it again with a current datasets, which writes the selected rows"
        )
    for file in files:
        if not os.path.isfile(file):
            raise DataFileError(
                f"{file}: listed in {state_path} but missing. Fix: copy the whole dataset "
                f"directory, or save it again"
            )
    return files


def _hf_documents(path: str, key: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa

    row = 0
    for file in _hf_files(path):
        where = f" ({os.path.basename(file)})"
        try:
            # not memory-mapped: one record batch is in memory at a time
            with pa.OSFile(file) as f:
                reader = pa.ipc.open_stream(f)
                _check_text_column(path + where, reader.schema, key)
                position = 0
                for batch in reader:
                    nbytes, position = f.tell() - position, f.tell()
                    column = batch.column(batch.schema.get_field_index(key))
                    yield from _column_texts(path, where, column, row, key, nbytes)
                    row += batch.num_rows
                yield "", f.size() - position  # the end-of-stream marker
        except (pa.ArrowException, OSError) as e:
            raise DataFileError(
                f"{path}: row {row}{where}: cannot be read as an Arrow stream ({_reason(e)}). "
                f"Fix: save the dataset again with Dataset.save_to_disk"
            ) from None


def _check_text_column(path: str, schema, key: str) -> None:
    """DataFileError unless an Arrow schema has a string column `key`."""
    import pyarrow as pa

    index = schema.get_field_index(key)
    if index < 0:
        raise DataFileError(
            f"{path}: has no column {key!r}, so no row has text (columns: "
            f"{', '.join(schema.names)}). Fix: pass --text-column with the column of the text"
        )
    kind = schema.field(index).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_view(pa, kind)):
        raise DataFileError(
            f"{path}: column {key!r} holds {kind}, not strings (in every row, from row 0). "
            f"Fix: pass --text-column with the column of the text"
        )


def _is_view(pa, kind) -> bool:
    return hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind)


def _column_texts(path: str, where: str, column, first_row: int, key: str, nbytes: int):
    """(text, bytes) for each row of a string column; the first row carries `nbytes`."""
    if column.null_count:
        import pyarrow.compute as pc

        bad = first_row + pc.index(column.is_null(), True).as_py()
        raise DataFileError(
            f"{path}: row {bad}{where}: {key!r} is null, not a string. Fix: drop or fill the rows "
            f"without text"
        )
    for text in column.to_pylist():
        yield text, nbytes
        nbytes = 0


def _reason(error: Exception) -> str:
    """An Arrow error's message on one line (they end in newlines and name C++ source lines)."""
    return " ".join(str(error).split())
