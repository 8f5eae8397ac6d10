"""Indexed .bin/.idx datasets: round trip, validation on open, atomic (re)builds."""

import os

import numpy as np
import pytest

from megatron_lite.data import DataFileError, IndexedDataset, IndexedDatasetBuilder
from megatron_lite.data.indexed_dataset import best_dtype


def _docs(seed=0, n=20, vocab=1000):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(rng.integers(1, 50))) for _ in range(n)]
    docs[3] = np.array([], dtype=np.int64)  # empty documents are legal
    return docs


def _build(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    return IndexedDataset(str(prefix))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    docs = _docs(vocab=70000 if dtype == np.int32 else 1000)
    ds = _build(tmp_path / "d", docs, dtype)
    assert len(ds) == len(docs)
    assert ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert ds.max_token_id == max(int(d.max()) for d in docs if len(d))
    assert os.path.getsize(tmp_path / "d.bin") == ds.num_tokens * np.dtype(dtype).itemsize
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc, err_msg=f"document {i} differs")
    np.testing.assert_array_equal(ds[-1], docs[-1])
    np.testing.assert_array_equal(ds.get(5, 2, 3), docs[5][2:5])
    with pytest.raises(IndexError):
        ds[len(docs)]
    with pytest.raises(IndexError):
        ds.get(5, 0, len(docs[5]) + 1)


def test_empty_dataset_opens(tmp_path):
    ds = _build(tmp_path / "e", [])
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.max_token_id == -1


def test_dtype_choice_and_overflow(tmp_path):
    assert best_dtype(65499) == np.uint16 and best_dtype(65500) == np.int32
    with IndexedDatasetBuilder(str(tmp_path / "o"), np.uint16) as builder:
        with pytest.raises(ValueError, match="int32"):
            builder.add_document([1, 70000])
        with pytest.raises(ValueError, match=r"\[0, 65535\]"):
            builder.add_document([-1])


def test_truncated_bin_names_file_and_fix(tmp_path):
    _build(tmp_path / "d", _docs())
    size = os.path.getsize(tmp_path / "d.bin")
    with open(tmp_path / "d.bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(DataFileError) as err:
        IndexedDataset(str(tmp_path / "d"))
    msg = str(err.value)
    assert str(tmp_path / "d.bin") in msg and "truncated" in msg and "preprocess_data.py" in msg
    assert isinstance(err.value, ValueError)


def test_mismatched_idx_names_file(tmp_path):
    _build(tmp_path / "a", _docs(seed=1))
    _build(tmp_path / "b", _docs(seed=2))
    os.replace(tmp_path / "b.idx", tmp_path / "a.idx")
    with pytest.raises(DataFileError, match=str(tmp_path / "a.bin")):
        IndexedDataset(str(tmp_path / "a"))


@pytest.mark.parametrize(
    "corrupt, rule",
    [
        (lambda b: b"XXXXXXXX" + b[8:], "bad magic"),
        (lambda b: b[:8] + (2).to_bytes(8, "little") + b[16:], "version 2"),
        (lambda b: b[:-5], "truncated"),
        (lambda b: b[:-8] + (123).to_bytes(8, "little"), "offsets disagree"),
    ],
)
def test_corrupt_idx_names_file_and_rule(tmp_path, corrupt, rule):
    _build(tmp_path / "d", _docs())
    path = tmp_path / "d.idx"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(DataFileError, match=rule) as err:
        IndexedDataset(str(tmp_path / "d"))
    assert str(path) in str(err.value) and "preprocess_data.py" in str(err.value)


def test_missing_file(tmp_path):
    _build(tmp_path / "d", _docs())
    os.remove(tmp_path / "d.bin")
    with pytest.raises(DataFileError, match="does not exist") as err:
        IndexedDataset(str(tmp_path / "d"))
    assert str(tmp_path / "d.bin") in str(err.value)


def test_failed_build_leaves_no_files(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetBuilder(str(tmp_path / "d")) as builder:
            builder.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == [], "an interrupted build must leave nothing behind"


def test_interrupted_rebuild_keeps_old_dataset(tmp_path):
    old = _docs(seed=1)
    _build(tmp_path / "d", old)
    before = {p: (tmp_path / p).read_bytes() for p in ("d.bin", "d.idx")}
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetBuilder(str(tmp_path / "d")) as builder:
            builder.add_document([7] * 1000)
            raise KeyboardInterrupt
    # A process killed outright never finalizes: its temporaries must not replace the dataset.
    crashed = IndexedDatasetBuilder(str(tmp_path / "d"))
    crashed.add_document([9] * 1000)
    assert {p: (tmp_path / p).read_bytes() for p in ("d.bin", "d.idx")} == before
    ds = IndexedDataset(str(tmp_path / "d"))
    for i, doc in enumerate(old):
        np.testing.assert_array_equal(ds[i], doc)
    crashed.abort()
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx", "d.maxid.json"]


def test_rebuild_replaces_dataset(tmp_path):
    _build(tmp_path / "d", _docs(seed=1))
    new = _docs(seed=2, n=5)
    ds = _build(tmp_path / "d", new)
    assert len(ds) == 5
    np.testing.assert_array_equal(ds[4], new[4])
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx", "d.maxid.json"]
