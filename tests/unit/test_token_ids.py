"""The largest token id of a dataset is proven against its .bin on every open: recorded by the
builder in a fingerprinted sidecar, scanned once for older datasets (and cached), rescanned
when the .bin changed, and a .bin that disagrees with its index is rejected."""

import json
import os

import numpy as np
import pytest

from megatron_lite.data import DataFileError, IndexedDataset, IndexedDatasetBuilder, token_ids


def _build(prefix, top=300, docs=30) -> int:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(prefix)) as builder:
        for _ in range(docs):
            builder.add_document(rng.integers(0, top, 50))
        builder.add_document([top - 1])
    return top - 1


@pytest.fixture
def scans(monkeypatch):
    """Counts the full .bin scans."""
    calls = []
    real = token_ids.scan

    def counting(tokens):
        calls.append(tokens.size)
        return real(tokens)

    monkeypatch.setattr(token_ids, "scan", counting)
    return calls


def test_builder_records_the_range_so_opening_scans_nothing(tmp_path, scans):
    top = _build(tmp_path / "d")
    record = json.loads((tmp_path / "d.maxid.json").read_text())
    assert record["max_token_id"] == top and record["size"] == os.path.getsize(tmp_path / "d.bin")
    assert IndexedDataset(str(tmp_path / "d")).max_token_id == top
    assert scans == [], "a dataset with a matching sidecar must not be scanned"


def test_older_dataset_is_scanned_once_and_cached(tmp_path, scans):
    top = _build(tmp_path / "d")
    os.remove(tmp_path / "d.maxid.json")  # as written before the sidecar existed
    for _ in range(3):
        assert IndexedDataset(str(tmp_path / "d")).max_token_id == top
    assert len(scans) == 1, f"scanned {len(scans)} times, want once"
    assert json.loads((tmp_path / "d.maxid.json").read_text())["max_token_id"] == top


@pytest.mark.parametrize("change", ["mtime", "content", "garbled sidecar"])
def test_stale_or_broken_cache_is_rescanned(tmp_path, scans, change):
    top = _build(tmp_path / "d")
    bin_path, side = tmp_path / "d.bin", tmp_path / "d.maxid.json"
    if change == "mtime":  # e.g. copied without preserving times: same ids, so it loads
        st = os.stat(bin_path)
        os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif change == "content":  # same size and mtime, other content: the sampled digest differs
        st = os.stat(bin_path)
        data = bytearray(bin_path.read_bytes())
        data[:2] = np.uint16(top + 1000).tobytes()
        bin_path.write_bytes(bytes(data))
        os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        side.write_text("{not json")
    if change == "content":
        with pytest.raises(DataFileError, match=f"holds token ids .*{top + 1000}"):
            IndexedDataset(str(tmp_path / "d"))
    else:
        assert IndexedDataset(str(tmp_path / "d")).max_token_id == top
        assert IndexedDataset(str(tmp_path / "d")).max_token_id == top
    assert len(scans) == 1


def test_random_bin_of_the_right_size_is_rejected(tmp_path):
    _build(tmp_path / "d")
    size = os.path.getsize(tmp_path / "d.bin")
    noise = np.random.default_rng(1).integers(0, 65535, size // 2, dtype=np.uint16)
    (tmp_path / "d.bin").write_bytes(noise.tobytes())
    with pytest.raises(DataFileError) as err:
        IndexedDataset(str(tmp_path / "d"))
    msg = str(err.value)
    assert str(tmp_path / "d.bin") in msg and f"..{int(noise.max())}," in msg and "Fix:" in msg


def test_read_only_dataset_directory_still_loads(tmp_path, scans, monkeypatch):
    top = _build(tmp_path / "d")
    os.remove(tmp_path / "d.maxid.json")

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(token_ids.json, "dump", refuse)  # as if the directory were read-only
    assert IndexedDataset(str(tmp_path / "d")).max_token_id == top
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"], "no temporary left behind"


def test_scan_is_exact_across_chunks(monkeypatch):
    monkeypatch.setattr(token_ids, "_CHUNK", 7)
    tokens = np.arange(100, dtype=np.int32)[::-1].copy()
    tokens[55] = -3
    assert token_ids.scan(tokens) == (-3, 99) and token_ids.scan(tokens[:0]) == (0, -1)
