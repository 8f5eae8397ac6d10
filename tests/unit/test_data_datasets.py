"""GPT sample windows, mock data, blending and the per-step microbatch sampler."""

from collections import Counter

import numpy as np
import pytest
import torch

from megatron_lite.data import (
    BlendedDataset,
    DataFileError,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    MockDataset,
)
from megatron_lite.data.sampler import microbatches_for_step

SEQ = 8
# A span of samples well past the start (the block size of an earlier blending implementation).
FAR = 16384


@pytest.fixture
def indexed(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=int(rng.integers(1, 40))) for _ in range(30)]
    docs[7] = np.array([], dtype=np.int64)
    with IndexedDatasetBuilder(str(tmp_path / "d")) as builder:
        for doc in docs:
            builder.add_document(doc)
    return IndexedDataset(str(tmp_path / "d"))


def _reference_windows(indexed, doc_order, seq):
    """Plain-python windows: stream = docs in doc_order; window j = stream[j*s : j*s+s+1]."""
    stream = []
    for d in doc_order:
        stream.extend(int(t) for t in indexed[int(d)])
    n = (len(stream) - 1) // seq
    return [tuple(stream[j * seq : j * seq + seq + 1]) for j in range(n)]


def test_windows_match_reference(indexed):
    ds = GPTDataset(indexed, SEQ, seed=1)
    assert sorted(ds.doc_order.tolist()) == list(range(len(indexed)))
    ref = _reference_windows(indexed, ds.doc_order, SEQ)
    assert ds.num_samples == len(ref)
    for j, window in enumerate(ref):
        assert tuple(ds.window(j * SEQ, SEQ + 1)) == window, f"stream window {j} differs"
    sample = ds[0]
    assert sample.dtype == np.int64 and sample.shape == (SEQ + 1,)


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_each_epoch_is_a_permutation_of_the_windows(indexed, epoch):
    ds = GPTDataset(indexed, SEQ, seed=1)
    ref = _reference_windows(indexed, ds.doc_order, SEQ)
    n = ds.num_samples
    got = [tuple(ds[i]) for i in range(epoch * n, (epoch + 1) * n)]
    assert Counter(got) == Counter(ref), f"epoch {epoch} is not a permutation of the windows"


def test_same_seed_same_samples_other_seed_differs(indexed):
    a, b, c = (GPTDataset(indexed, SEQ, seed=s) for s in (1, 1, 2))
    n = a.num_samples
    idx = list(range(0, 3 * n, 3))
    # Random access order must not matter: b is read backwards.
    first = [a[i] for i in idx]
    second = [b[i] for i in reversed(idx)][::-1]
    for i, x, y in zip(idx, first, second, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=f"sample {i} differs for the same seed")
    assert any(not np.array_equal(a[i], c[i]) for i in range(n)), "seed must change the order"
    assert [tuple(a[i]) for i in range(n)] != [tuple(a[i]) for i in range(n, 2 * n)], (
        "each epoch must have its own order"
    )


def test_too_little_data_is_an_error(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "t")) as builder:
        builder.add_document([1, 2, 3])
    with pytest.raises(DataFileError, match="seq_length"):
        GPTDataset(IndexedDataset(str(tmp_path / "t")), seq_length=3, seed=0)


def test_mock_dataset_is_deterministic():
    a, b, c = MockDataset(100, SEQ, 7), MockDataset(100, SEQ, 7), MockDataset(100, SEQ, 8)
    for i in (0, 1, 10**9):
        x = a[i]
        assert x.dtype == np.int64 and x.shape == (SEQ + 1,)
        assert x.min() >= 0 and x.max() < 100
        np.testing.assert_array_equal(x, b[i])
        assert not np.array_equal(x, c[i])
    assert not np.array_equal(a[0], a[1])


class _Tagged:
    """Fake dataset whose sample j is [k, j], so the blend's choices are visible."""

    seq_length = 1

    def __init__(self, k):
        self.k = k

    def __getitem__(self, j):
        return np.array([self.k, j], dtype=np.int64)


def test_blending_tracks_weights_and_counts():
    weights = [0.5, 0.3, 0.2]
    n = 2 * FAR + 100
    blend = BlendedDataset([_Tagged(k) for k in range(3)], weights, seed=0)
    picks = np.stack([blend[i] for i in range(n)])  # [n, 2]: (dataset, its running index)
    onehot = np.eye(3, dtype=np.int64)[picks[:, 0]]
    achieved = np.cumsum(onehot, axis=0)  # [n, 3] counts after each sample
    target = np.arange(1, n + 1)[:, None] * np.asarray(weights)[None]
    assert np.abs(achieved - target).max() <= 1.0, "greedy blend drifted from the weights"
    for k in range(3):
        used = picks[picks[:, 0] == k, 1]
        np.testing.assert_array_equal(used, np.arange(len(used)), err_msg=f"dataset {k} order")


def test_blending_random_access_is_deterministic():
    sets = [_Tagged(k) for k in range(2)]
    seq = BlendedDataset(sets, [1.0, 2.0], seed=3)
    rand = BlendedDataset(sets, [1.0, 2.0], seed=3)
    idx = [3 * FAR + 5, 17, FAR, 2 * FAR - 1]
    got = {i: rand[i] for i in idx}  # a far block first
    for i in sorted(idx):
        np.testing.assert_array_equal(got[i], seq[i], err_msg=f"blended sample {i}")


def test_blending_rejects_bad_weights():
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset([_Tagged(0)], [1.0, 1.0], seed=0)
    with pytest.raises(ValueError, match=">= 0"):
        BlendedDataset([_Tagged(0), _Tagged(1)], [1.0, -1.0], seed=0)


@pytest.mark.parametrize("dp, mbs", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_microbatches_concatenate_to_dp1_result(dp, mbs):
    ds, gbs = MockDataset(50, SEQ, seed=0), 8
    for step in (0, 3):
        whole = torch.cat(microbatches_for_step(ds, step, gbs, gbs, 0, 1))
        expected = np.stack([ds[i] for i in range(step * gbs, (step + 1) * gbs)])
        np.testing.assert_array_equal(whole.numpy(), expected)
        parts = []
        for rank in range(dp):
            mbs_list = microbatches_for_step(ds, step, gbs, mbs, rank, dp)
            assert len(mbs_list) == gbs // (dp * mbs)
            for mb in mbs_list:
                assert mb.dtype == torch.long and mb.shape == (mbs, SEQ + 1)
            parts.extend(mbs_list)
        torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)


def test_microbatches_reject_indivisible_batch():
    with pytest.raises(ValueError, match="global_batch_size=6"):
        microbatches_for_step(MockDataset(50, SEQ, 0), 0, 6, 2, 0, 2)
