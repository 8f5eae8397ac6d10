"""tools/preprocess_data.py's input formats: the same documents as plain JSON lines, gzip and zstd
JSON lines, Parquet and a dataset saved with `datasets.Dataset.save_to_disk` give byte-identical
.bin/.idx (whose documents are the tokenizer's own encoding of the texts); 1 and 4 workers over
many inputs and a glob give identical files; every corrupt input is named with its file and
line or row and writes nothing; a missing optional package is named with the extra to install."""

import ast
import glob
import gzip
import importlib.util
import json
import os
import random
import re
import sys

import pytest

from megatron_lite.data import DataFileError, IndexedDataset, Tokenizer, readers
from megatron_lite.data import preprocess as preprocess_module
from megatron_lite.data.preprocess import preprocess

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
tokenizers = pytest.importorskip("tokenizers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREPROCESS = os.path.join(REPO, "tools", "preprocess_data.py")
OPTIONAL = {"pyarrow", "zstandard", "datasets"}  # the [data] extra, and datasets (tests only)
_spec = importlib.util.spec_from_file_location("preprocess_data", PREPROCESS)
preprocess_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preprocess_data)


def _texts(n=300, seed=0) -> list[str]:
    """Documents with what readers get wrong: non-ASCII, newlines and quotes inside a document,
    empty and whitespace-only documents (skipped by every format alike)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdéfgh") for _ in range(rng.randint(2, 6))) for _ in range(60)]
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
        if i % 7 == 0:
            text += '\nsecond "line"\r\n\tü €'
        out.append("" if i % 50 == 3 else "  \n " if i % 50 == 9 else text)
    return out


def _jsonl(texts) -> bytes:
    return "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)).encode()


def _two_parts(data: bytes) -> tuple[bytes, bytes]:
    return data[: len(data) // 2], data[len(data) // 2 :]


def _write_formats(root, texts) -> dict[str, str]:
    """The same documents in every format, each written by its own library: {format: path}.
    The compressed files hold two members / frames and the Parquet file several row groups."""
    import datasets

    data = _jsonl(texts)
    paths = {f: str(root / n) for f, n in [("jsonl", "d.jsonl"), ("jsonl.gz", "d.jsonl.gz")]}
    paths |= {"jsonl.zst": str(root / "d.jsonl.zst"), "parquet": str(root / "d.parquet")}
    paths["hf"] = str(root / "hf")
    open(paths["jsonl"], "wb").write(data)
    open(paths["jsonl.gz"], "wb").write(b"".join(gzip.compress(p) for p in _two_parts(data)))
    zstd = zstandard.ZstdCompressor()
    open(paths["jsonl.zst"], "wb").write(b"".join(zstd.compress(p) for p in _two_parts(data)))
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    pq.write_table(table, paths["parquet"], row_group_size=70)
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).save_to_disk(
        paths["hf"], num_shards=3
    )
    return paths


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained here (as test_hf_tokenizer's)."""
    root = tmp_path_factory.mktemp("tok")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(), trainer)
    tok.save(str(root / "tokenizer.json"))
    return str(root / "tokenizer.json")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _write_formats(tmp_path_factory.mktemp("in"), _texts())


def _files(prefix) -> dict[str, bytes]:
    return {ext: open(f"{prefix}{ext}", "rb").read() for ext in (".bin", ".idx")}


def test_every_format_gives_the_same_dataset(tok, inputs, tmp_path, monkeypatch):
    # small batches: documents cross Parquet batches, row groups and tokenizer batches
    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 16)
    monkeypatch.setattr(readers, "_COMPRESSED_CHUNK", 512)
    monkeypatch.setattr(preprocess_module, "_BATCH_CHARS", 3000)
    out = {}
    for fmt, path in inputs.items():
        assert readers.detect_format(path) == fmt
        # the progress bar counts every byte of the input once: it ends at 100%
        counted = sum(n for _, n in readers.iter_documents(path, fmt))
        assert counted == readers.input_size(path, fmt), f"{fmt}: progress counts {counted} bytes"
        stats = preprocess([path], tok, str(tmp_path / fmt.replace(".", "_")), progress=False)
        out[fmt] = _files(stats.prefix)
    for fmt in inputs:
        for ext in (".bin", ".idx"):
            assert out[fmt][ext] == out["jsonl"][ext], f"{fmt}: {ext} differs from plain .jsonl"
    tokenizer, ds = Tokenizer(tok), IndexedDataset(str(tmp_path / "jsonl"))
    expected = [t for t in _texts() if t.strip()]
    assert len(ds) == len(expected) == 288
    for i in range(len(ds)):
        assert ds[i].tolist() == tokenizer.encode(expected[i]) + [tokenizer.eos_id], f"doc {i}"


def test_many_inputs_and_workers_give_identical_files(tok, tmp_path, monkeypatch):
    """Shards matched by a glob come sorted by name (part-10 after part-09); mixed formats in the
    order given; 1 and 4 worker processes write the same bytes."""
    monkeypatch.setattr(preprocess_module, "_BATCH_CHARS", 2000)  # ~40 batches over 4 workers
    texts = _texts(600, seed=1)
    shards = tmp_path / "shards"
    shards.mkdir()
    order = [9, 10, 2]  # written out of order: the glob must sort them
    parts = [texts[i * 100 : (i + 1) * 100] for i in range(6)]
    for k, number in enumerate(order):
        table = pa.table({"text": parts[k]})
        pq.write_table(table, shards / f"part-{number:02d}.parquet", row_group_size=30)
    rest = _write_formats(tmp_path, parts[3] + parts[4] + parts[5])
    # by name: part-02, part-09, part-10 = parts[2], parts[0], parts[1]
    argv = ["--input", rest["jsonl.gz"], str(shards / "part-*.parquet"), rest["hf"]]
    argv += ["--tokenizer-model", tok, "--quiet"]
    for workers in (1, 4):
        prefix = str(tmp_path / f"w{workers}")
        assert (
            preprocess_data.main([*argv, "--workers", str(workers), "--output-prefix", prefix]) == 0
        )
    assert _files(tmp_path / "w1") == _files(tmp_path / "w4"), "1 and 4 workers differ"
    expected = parts[3] + parts[4] + parts[5] + parts[2] + parts[0] + parts[1]
    expected += parts[3] + parts[4] + parts[5]
    expected = [t for t in expected if t.strip()]
    tokenizer, ds = Tokenizer(tok), IndexedDataset(str(tmp_path / "w4"))
    assert len(ds) == len(expected)
    for i in range(0, len(ds), 37):
        assert ds[i].tolist() == tokenizer.encode(expected[i]) + [tokenizer.eos_id], f"doc {i}"


def _flip(data: bytes, at: int, n: int = 64) -> bytes:
    return data[:at] + bytes(b ^ 0xA5 for b in data[at : at + n]) + data[at + n :]


def _corrupt(kind: str, root) -> tuple[str, str]:
    """(the bad input, a regex its error must match: the file and the line or row)."""
    rng = random.Random(kind)  # random words: the compressed files span several 64 KiB reads
    texts = [f"doc {i}: " + " ".join(str(rng.random()) for _ in range(12)) for i in range(3000)]
    data = _jsonl(texts)
    # with the frame checksum, as the zstd CLI writes (without it, corruption that still decodes
    # goes unseen; gzip always has its CRC)
    zstd = zstandard.ZstdCompressor(level=1, write_checksum=True)
    if kind in ("gz-corrupt", "gz-truncated", "zst-corrupt", "zst-truncated"):
        packed = gzip.compress(data) if kind.startswith("gz") else zstd.compress(data)
        packed = _flip(packed, len(packed) // 2) if "corrupt" in kind else packed[:-200]
        path = root / ("bad.jsonl.gz" if kind.startswith("gz") else "bad.jsonl.zst")
        path.write_bytes(packed)
        # a corrupt stream may first decode to a broken line: named as such, with its number
        what = "is corrupt from this line on|not a JSON|not valid UTF-8"
        what = what if "corrupt" in kind else "ends in the middle"
        return str(path), rf"{re.escape(str(path))}:([2-9]|\d\d+): (the \w+ stream )?({what})"
    if kind in ("gz-bad-json", "zst-not-string"):
        lines = data.split(b"\n")
        lines[1233] = b'{"text": "unterminated' if kind == "gz-bad-json" else b'{"text": 5}'
        data = b"\n".join(lines)
        path = root / ("bad.jsonl.gz" if kind == "gz-bad-json" else "bad.jsonl.zst")
        path.write_bytes(gzip.compress(data) if kind == "gz-bad-json" else zstd.compress(data))
        return str(path), rf"{re.escape(str(path))}:1234: (not a JSON|no string field 'text')"
    path = root / "bad.parquet"
    if kind == "parquet-garbage":
        path.write_bytes(b"PAR1" + os.urandom(3000))
        return str(path), rf"{re.escape(str(path))}: not a readable Parquet file"
    if kind == "parquet-row-group":
        pq.write_table(pa.table({"text": texts}), path, row_group_size=1000)
        page = pq.ParquetFile(path).metadata.row_group(2).column(0).data_page_offset
        path.write_bytes(_flip(path.read_bytes(), page + 3, 8))  # row group 2's page header
        return str(path), rf"{re.escape(str(path))}: row 2000: row group 2 \(rows 2000..2999\)"
    if kind == "parquet-no-column":
        pq.write_table(pa.table({"content": texts}), path)
        return str(path), rf"{re.escape(str(path))}: has no column 'text'.*content"
    if kind == "parquet-not-string":
        pq.write_table(pa.table({"text": list(range(5))}), path)
        return str(path), rf"{re.escape(str(path))}: column 'text' holds int64, not strings"
    if kind == "parquet-null":
        pq.write_table(pa.table({"text": texts[:1717] + [None] + texts[1718:]}), path)
        return str(path), rf"{re.escape(str(path))}: row 1717: 'text' is null"
    import datasets

    hf = root / "hf"
    rows = texts[:2500] + [None] + texts[2501:] if kind == "hf-null" else texts
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(hf), num_shards=2)
    if kind == "hf-null":  # row 2500 is the second shard's row 1000
        return str(hf), rf"{re.escape(str(hf))}: row 2500 \(data-00001-of-00002.arrow\): 'text' is"
    shard = hf / "data-00001-of-00002.arrow"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return str(hf), rf"{re.escape(str(hf))}: row 1500 \(data-00001-of-00002.arrow\): cannot be read"


CORRUPT = [
    "gz-corrupt",
    "gz-truncated",
    "gz-bad-json",
    "zst-corrupt",
    "zst-truncated",
    "zst-not-string",
    "parquet-garbage",
    "parquet-row-group",
    "parquet-no-column",
    "parquet-not-string",
    "parquet-null",
    "hf-null",
    "hf-truncated",
]


@pytest.mark.parametrize("kind", CORRUPT)
def test_a_corrupt_input_is_named_and_nothing_is_written(tok, inputs, tmp_path, capsys, kind):
    """After a good input (so the temporaries hold documents): exit 2, the file and the line or
    row in the message, the dataset it would replace byte for byte, no file added or removed."""
    (tmp_path / "in").mkdir()
    bad, pattern = _corrupt(kind, tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    prefix = str(out / "kept")
    assert preprocess([inputs["jsonl"]], tok, prefix, progress=False).documents == 288
    before, listing = _files(prefix), sorted(os.listdir(out))
    argv = ["--input", inputs["jsonl"], bad, "--tokenizer-model", tok, "--quiet"]
    assert preprocess_data.main([*argv, "--output-prefix", prefix]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err, re.S), f"{kind}: expected /{pattern}/ in:\n{err}"
    assert "Traceback" not in err and "Fix:" in err, err
    assert _files(prefix) == before, f"{kind}: the existing dataset was changed"
    assert sorted(os.listdir(out)) == listing, f"{kind}: files added or removed"


def test_a_missing_optional_package_is_named_with_the_extra(inputs, tok, tmp_path, monkeypatch):
    """Without pyarrow and zstandard (blocked in sys.modules) plain and gzip JSON lines still
    preprocess, and a Parquet, .jsonl.zst or dataset input names what it needs before any work."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    prefix = str(tmp_path / "ok")
    assert preprocess([inputs["jsonl"], inputs["jsonl.gz"]], tok, prefix, progress=False).documents
    needs = {"parquet": "Parquet", "jsonl.zst": "zstd-compressed JSON lines", "hf": "Hugging Face"}
    for fmt, what in needs.items():
        with pytest.raises(DataFileError) as err:
            preprocess([inputs["jsonl"], inputs[fmt]], tok, str(tmp_path / fmt), progress=False)
        msg = str(err.value)
        assert inputs[fmt] in msg and what in msg and 'pip install -e ".[data]"' in msg, msg
        assert not [n for n in os.listdir(tmp_path) if n.startswith(fmt)], "wrote something"


def test_no_module_level_import_of_an_optional_package():
    """The quickstart's path (corpus -> preprocess) runs without the [data] extra because the
    data package and the CLI import pyarrow, zstandard and datasets only inside the readers
    that need them (checked on the source: an import at module level would fail at start-up)."""
    sources = glob.glob(os.path.join(REPO, "megatron_lite", "data", "*.py")) + [PREPROCESS]
    found = []
    for path in sources:
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in tree.body:  # module level only; function bodies import lazily
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"{path}:{node.lineno}: {n}" for n in names if n.split(".")[0] in OPTIONAL]
    assert not found, "module-level imports of optional packages:\n" + "\n".join(found)


def test_input_order_and_format_errors(inputs, tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("{}")
    pattern = str(tmp_path / "*.jsonl")
    assert readers.expand_inputs([str(tmp_path / "c.txt"), pattern]) == [
        str(tmp_path / n) for n in ("c.txt", "a.jsonl", "b.jsonl")
    ]
    with pytest.raises(DataFileError, match="given twice"):
        readers.expand_inputs([pattern, str(tmp_path / "a.jsonl")])
    with pytest.raises(DataFileError, match="matches no file"):
        readers.expand_inputs([str(tmp_path / "*.parquet")])
    (tmp_path / "x.txt.gz").write_bytes(gzip.compress(b"text"))
    with pytest.raises(DataFileError, match="--input-format jsonl.gz"):
        readers.detect_format(str(tmp_path / "x.txt.gz"))
    assert readers.detect_format(str(tmp_path / "x.txt.gz"), "jsonl.gz") == "jsonl.gz"
    with pytest.raises(DataFileError, match="not a dataset saved with datasets' save_to_disk"):
        readers.detect_format(str(tmp_path))
