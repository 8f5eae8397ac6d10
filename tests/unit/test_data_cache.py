"""Cached, memory-mapped data indices: built once per machine, rebuilt when stale or damaged,
one builder under a lock; blending is periodic with O(1) lookup equal to a plain greedy."""

import json
import mmap
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from megatron_lite.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    blended_dataset,
    gpt_dataset,
)

SEQ = 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build(prefix, n=40, seed=0):
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(str(prefix)) as builder:
        for _ in range(n):
            builder.add_document(rng.integers(0, 500, size=int(rng.integers(1, 40))))
    return IndexedDataset(str(prefix))


def _cache_files(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith(".npy"))


def _mtimes(directory):
    return {f: os.stat(os.path.join(directory, f)).st_mtime_ns for f in _cache_files(directory)}


def test_built_once_then_memory_mapped(tmp_path):
    indexed = _build(tmp_path / "d")
    first = GPTDataset(indexed, SEQ, seed=1)
    cache = tmp_path / "index_cache"
    names = _cache_files(cache)
    assert first.indices_built and len(names) == 3, names
    before = _mtimes(cache)
    second = GPTDataset(IndexedDataset(str(tmp_path / "d")), SEQ, seed=1)
    assert not second.indices_built, "a valid cache must be reused, not rebuilt"
    assert _mtimes(cache) == before
    assert isinstance(second.doc_order, np.memmap)
    for i in range(0, 3 * first.num_samples, 5):
        np.testing.assert_array_equal(first[i], second[i], err_msg=f"sample {i}")


def test_idx_is_memory_mapped(tmp_path):
    indexed = _build(tmp_path / "d")
    for name in ("sizes", "offsets"):
        view = getattr(indexed, name).base
        assert isinstance(view, memoryview) and isinstance(view.obj, mmap.mmap), name


def test_key_follows_inputs(tmp_path):
    indexed = _build(tmp_path / "d")
    GPTDataset(indexed, SEQ, seed=1)
    assert not GPTDataset(indexed, SEQ, seed=1).indices_built
    assert GPTDataset(indexed, SEQ, seed=2).indices_built, "another seed is another key"
    assert GPTDataset(indexed, SEQ + 1, seed=1).indices_built, "another seq length too"
    _build(tmp_path / "d", seed=5)  # new data files: new sizes/mtimes
    fresh = GPTDataset(IndexedDataset(str(tmp_path / "d")), SEQ, seed=1)
    assert fresh.indices_built, "a changed dataset must not reuse the old indices"


def _damage(path, how):
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 3)
    elif how == "corrupted":  # same size, other bytes
        data = bytearray(path.read_bytes())
        data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
        path.write_bytes(bytes(data))
    elif how == "stale record":
        record = json.loads(path.with_suffix(".json").read_text())
        record["key"] = "0" * 16
        path.with_suffix(".json").write_text(json.dumps(record))
    elif how == "no record":
        os.remove(path.with_suffix(".json"))
    else:
        path.with_suffix(".json").write_text("{garbled")


@pytest.mark.parametrize("how", ["truncated", "corrupted", "stale record", "no record", "garbled"])
def test_damaged_cache_is_rebuilt_not_trusted(tmp_path, how):
    indexed = _build(tmp_path / "d")
    good = GPTDataset(indexed, SEQ, seed=1)
    expected = [good[i].copy() for i in range(good.num_samples)]
    cache = tmp_path / "index_cache"
    target = next(cache / f for f in _cache_files(cache) if f.endswith("doc_ends.npy"))
    _damage(target, how)
    again = GPTDataset(indexed, SEQ, seed=1)
    assert again.indices_built, f"a {how} cache was trusted"
    for i, x in enumerate(expected):
        np.testing.assert_array_equal(again[i], x, err_msg=f"sample {i} after rebuild ({how})")
    assert not GPTDataset(indexed, SEQ, seed=1).indices_built, "the rebuilt cache is valid"


def test_large_epoch_orders_are_cached_too(tmp_path, monkeypatch):
    monkeypatch.setattr(GPTDataset, "SHUFFLE_CACHE_MIN", 0)
    indexed = _build(tmp_path / "d")
    ds = GPTDataset(indexed, SEQ, seed=1)
    ds[2 * ds.num_samples]  # epoch 2
    assert any(f.endswith("shuffle2.npy") for f in _cache_files(tmp_path / "index_cache"))
    monkeypatch.setattr(GPTDataset, "SHUFFLE_CACHE_MIN", 1 << 30)
    ref = GPTDataset(indexed, SEQ, seed=1)  # computed in memory
    for i in range(2 * ds.num_samples, 3 * ds.num_samples):
        np.testing.assert_array_equal(ds[i], ref[i], err_msg=f"sample {i}")


_CHILD = """
import sys, time
from megatron_lite.data import GPTDataset, IndexedDataset, gpt_dataset
real = GPTDataset._build
def slow(self):
    time.sleep(0.5)  # hold the lock long enough for the other process to arrive
    return real(self)
GPTDataset._build = slow
ds = GPTDataset(IndexedDataset(sys.argv[1]), 8, seed=1)
print("BUILT" if ds.indices_built else "LOADED", ds[3].tolist())
"""


def test_concurrent_processes_build_once(tmp_path):
    _build(tmp_path / "d")
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-c", _CHILD, str(tmp_path / "d")]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(o.split()[0] for o in outs) == ["BUILT", "LOADED"], outs
    assert outs[0].split(" ", 1)[1] == outs[1].split(" ", 1)[1], "both must see the same data"


class _Tagged:
    seq_length = 1

    def __init__(self, k):
        self.k = k

    def __getitem__(self, j):
        return np.array([self.k, j], dtype=np.int64)


def _reference_blend(q, tie_order, n):
    """Plain greedy with exact fractions: sample t goes to the dataset lagging w_k·(t+1) most."""
    total = sum(q)
    w = [Fraction(x, total) for x in q]
    counts, out = [0] * len(q), []
    for t in range(n):
        k = max(tie_order, key=lambda k: w[k] * (t + 1) - counts[k])  # first of equal keys
        out.append((k, counts[k]))
        counts[k] += 1
    return out


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [3.0, 1.0], [0.1234, 0.5, 0.3766, 1e-3]])
def test_blend_lookup_equals_plain_greedy(monkeypatch, weights):
    monkeypatch.setattr(blended_dataset, "MAX_PERIOD", 1 << 11)  # several periods in n samples
    blend = BlendedDataset([_Tagged(k) for k in range(len(weights))], weights, seed=4)
    assert blend.period <= 1 << 11 and all(blend.q > 0)
    assert np.allclose(blend.q / blend.period, np.array(weights) / sum(weights), atol=2**-11)
    tie = gpt_dataset.seeded_rng(4, gpt_dataset.BLEND_STREAM).permutation(len(weights)).tolist()
    n = 5 * blend.period + 7
    ref = _reference_blend(blend.q.tolist(), tie, n)
    for i in [n - 1, 0, 3 * blend.period + 5, blend.period, 17]:  # any order: O(1) lookups
        assert blend.locate(i) == ref[i], f"blended sample {i}"
    ks, js = blend.locate_many(np.arange(n))
    assert list(zip(ks.tolist(), js.tolist(), strict=True)) == ref
    far = 10**12 + 3
    k, j = blend.locate(far)
    p, r = divmod(far, blend.period)
    assert (k, j) == (ref[r][0], p * int(blend.q[k]) + ref[r][1]), "sample 10^12 + 3"


def test_blend_indices_cached(tmp_path):
    sets = [_Tagged(k) for k in range(3)]
    first = BlendedDataset(sets, [0.2, 0.7, 0.1234], seed=0, cache_dir=str(tmp_path))
    second = BlendedDataset(sets, [0.2, 0.7, 0.1234], seed=0, cache_dir=str(tmp_path))
    assert first.indices_built and not second.indices_built
    assert first.period <= blended_dataset.MAX_PERIOD
    for i in (0, 99, 10**9):
        assert first.locate(i) == second.locate(i)


def test_unverified_open_is_checked_when_the_indices_are_built(tmp_path):
    from megatron_lite.data import DataFileError

    _build(tmp_path / "d")
    path = tmp_path / "d.idx"
    data = bytearray(path.read_bytes())
    n = len(IndexedDataset(str(tmp_path / "d")))
    at = len(data) - 8 * n + 8 * (n // 2)  # a middle offset: the O(1) checks cannot see it
    data[at : at + 8] = (12345).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    indexed = IndexedDataset(str(tmp_path / "d"), verify=False)
    with pytest.raises(DataFileError, match="offsets disagree"):
        GPTDataset(indexed, SEQ, seed=1)
    assert not os.path.isdir(tmp_path / "index_cache") or not _cache_files(tmp_path / "index_cache")


def test_prepare_builds_the_validation_indices_too(tmp_path):
    """The launcher's prepare() builds every index the ranks will open, the validation
    split's included (3 arrays per part), so no rank builds one after start-up."""
    from megatron_lite.train import prepare

    _build(tmp_path / "d", n=60)
    cache = tmp_path / "index_cache"
    common = [f"data.paths=[{tmp_path / 'd'}]", "model.seq_length=8", "data.split=90,10,0"]
    prepare([*common, "train.eval_interval=0"], world_size=1, hardware=False)
    train_only = _cache_files(cache)
    prepare([*common, "train.eval_interval=5"], world_size=1, hardware=False)
    both = _cache_files(cache)
    assert len(train_only) == 3 and len(both) == 6 and set(train_only) < set(both), both
