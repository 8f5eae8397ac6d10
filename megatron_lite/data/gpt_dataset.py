"""Sample datasets for GPT pretraining: every sample is int64 token ids of shape [seq_length+1].

All three datasets are infinite and index-addressable: `dataset[i]` for any i >= 0 depends only
on the seed and i, so the global sample order is independent of the parallel layout and a run
resumes exactly from its step count.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from megatron_lite.data.errors import DataFileError
from megatron_lite.data.indexed_dataset import IndexedDataset

# Stream tags of the seeded generators, so no two uses of one seed share random numbers.
_DOC_ORDER, _SAMPLE_ORDER, _MOCK, _BLEND = 0, 1, 2, 3


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed % 2**63, *keys])


class GPTDataset:
    """Windows of seq_length+1 tokens over the concatenation of all documents.

    The documents are concatenated (EOS tokens included, as preprocessed) in one seeded shuffled
    order; sample j of an epoch covers stream tokens [j*s, j*s + s + 1), so neighbouring windows
    share one token and every token is a target exactly once. There are
    `num_samples = (tokens - 1) // s` samples per epoch; index i maps to epoch i // num_samples,
    whose samples come in their own order seeded by (seed, epoch).
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int):
        self.indexed, self.seq_length, self.seed = indexed, seq_length, seed
        self.doc_order = _rng(seed, _DOC_ORDER).permutation(len(indexed))  # [docs]
        # End position in the stream of each document, in shuffled order: [docs]
        self._doc_ends = np.cumsum(indexed.sizes[self.doc_order], dtype=np.int64)
        total = int(self._doc_ends[-1]) if len(indexed) else 0
        self.num_samples = max(total - 1, 0) // seq_length
        if self.num_samples < 1:
            raise DataFileError(
                f"{indexed.bin_path}: {total} tokens are too few for one sample of "
                f"model.seq_length+1 = {seq_length + 1} tokens. Fix: use more data or a smaller "
                f"model.seq_length"
            )
        # Two epochs' orders suffice: a global batch straddles at most one epoch boundary.
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    def sample_index(self, i: int) -> int:
        """Position within the epoch's stream (in windows) of global sample i."""
        epoch, j = divmod(i, self.num_samples)
        order = self._orders.get(epoch)
        if order is None:
            order = _rng(self.seed, _SAMPLE_ORDER, epoch).permutation(self.num_samples)
            self._orders[epoch] = order
            if len(self._orders) > 2:
                self._orders.popitem(last=False)
        return int(order[j])

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of sample i: int64 [seq_length+1]."""
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        return self.window(self.sample_index(i) * self.seq_length, self.seq_length + 1)

    def window(self, start: int, length: int) -> np.ndarray:
        """Stream tokens [start, start+length) gathered across documents: int64 [length]."""
        out = np.empty(length, dtype=np.int64)
        d = int(np.searchsorted(self._doc_ends, start, side="right"))
        filled = 0
        while filled < length:
            doc_start = int(self._doc_ends[d - 1]) if d else 0
            offset = start + filled - doc_start
            take = min(int(self._doc_ends[d]) - doc_start - offset, length - filled)
            out[filled : filled + take] = self.indexed.get(int(self.doc_order[d]), offset, take)
            filled += take
            d += 1
        return out


class MockDataset:
    """Uniform random tokens: sample i is int64 [seq_length+1] drawn from a generator seeded by
    (seed, i). Deterministic and infinite; the loss cannot drop below ln(vocab_size)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"mock data needs a positive vocab_size, got {vocab_size!r}")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        rng = _rng(self.seed, _MOCK, i)
        return rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)


class BlendedDataset:
    """Mixes datasets so that the share of samples from each tracks its weight.

    Sample n goes to the dataset whose achieved count lags its target w_k·(n+1) the most
    (Megatron's greedy blending; ties go to a seeded order of the datasets), and takes that
    dataset's next sample: dataset k is indexed by its own running count. The choice is computed
    in blocks of BLOCK samples; the counts at each block start are kept, so any index costs at
    most one block of work after the blocks before it were visited once.
    """

    BLOCK = 16384
    _CACHED_BLOCKS = 4

    def __init__(self, datasets: list, weights: list[float], seed: int):
        if not datasets or len(datasets) != len(weights):
            raise ValueError(
                f"need one weight per dataset, got {len(datasets)} datasets and "
                f"{len(weights)} weights"
            )
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"blending weights must be >= 0 with a positive sum, got {weights}")
        lengths = {getattr(d, "seq_length", None) for d in datasets}
        if len(lengths) > 1:
            raise ValueError(f"blended datasets must share seq_length, got {sorted(lengths)}")
        self.datasets, self.seed = datasets, seed
        self.seq_length = lengths.pop()
        self.weights = (w / w.sum()).tolist()
        self._tie_order = _rng(seed, _BLEND).permutation(len(datasets)).tolist()
        self._block_starts = [[0] * len(datasets)]  # counts per dataset at each block start
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def locate(self, i: int) -> tuple[int, int]:
        """(dataset k, index into dataset k) of blended sample i."""
        b, t = divmod(i, self.BLOCK)
        choice, index = self._block(b)
        return int(choice[t]), int(index[t])

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of blended sample i: int64 [seq_length+1]."""
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        k, j = self.locate(i)
        return self.datasets[k][j]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if b in self._blocks:
            self._blocks.move_to_end(b)
            return self._blocks[b]
        while len(self._block_starts) <= b:  # walk forward to reach block b's start counts
            self._simulate(len(self._block_starts) - 1)
        result = self._simulate(b)
        self._blocks[b] = result
        if len(self._blocks) > self._CACHED_BLOCKS:
            self._blocks.popitem(last=False)
        return result

    def _simulate(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Run the greedy over block b: (dataset choice int32 [BLOCK], sample index int64)."""
        w, order = self.weights, self._tie_order
        counts = list(self._block_starts[b])
        choice = np.empty(self.BLOCK, dtype=np.int32)
        index = np.empty(self.BLOCK, dtype=np.int64)
        first = b * self.BLOCK
        for t in range(self.BLOCK):
            target = first + t + 1
            # max() keeps the first of equal keys, so ties follow the seeded order.
            k = max(order, key=lambda k: w[k] * target - counts[k])  # noqa: B023
            choice[t], index[t] = k, counts[k]
            counts[k] += 1
        if len(self._block_starts) == b + 1:
            self._block_starts.append(counts)
        return choice, index
