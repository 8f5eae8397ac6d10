"""Sample datasets for GPT pretraining: every sample is int64 token ids of shape [seq_length+1].

The datasets are infinite and index-addressable: `dataset[i]` for any i >= 0 depends only
on the seed and i, so the global sample order is independent of the parallel layout and a run
resumes exactly from its step count.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from megatron_lite.data.errors import DataFileError
from megatron_lite.data.index_cache import IndexCache, file_stamp
from megatron_lite.data.indexed_dataset import IndexedDataset

# Stream tags of the seeded generators, so no two uses of one seed share random numbers.
_DOC_ORDER, _SAMPLE_ORDER, _MOCK, BLEND_STREAM = 0, 1, 2, 3


def seeded_rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed % 2**63, *keys])


class GPTDataset:
    """Windows of seq_length+1 tokens over the concatenation of all documents.

    The documents are concatenated (EOS tokens included, as preprocessed) in one seeded shuffled
    order; sample j of an epoch covers stream tokens [j*s, j*s + s + 1), so neighbouring windows
    share one token and every token is a target exactly once. There are
    `num_samples = (tokens - 1) // s` samples per epoch; index i maps to epoch i // num_samples,
    whose samples come in their own order seeded by (seed, epoch).

    The indices are built once per machine and memory-mapped from `cache_dir` (default
    `index_cache/` beside the data; see `index_cache`): the document order `doc_order` [docs],
    the stream end of each document in that order `doc_ends` [docs], the document (position in
    `doc_order`) where each window starts `sample_doc` [num_samples], and each epoch's sample
    order (built when the epoch is first used; epochs under SHUFFLE_CACHE_MIN samples are
    computed in memory, which is faster than a file). `indices_built` says whether this process
    built them.
    """

    SHUFFLE_CACHE_MIN = 1 << 18
    _INDICES = ("doc_order", "doc_ends", "sample_doc")

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_length: int,
        seed: int,
        cache_dir: str | None = None,
        documents: tuple[int, int] | None = None,
    ):
        self.indexed, self.seq_length, self.seed = indexed, seq_length, seed
        self.documents = documents or (0, len(indexed))  # [first, last): a train/valid split
        fields = {
            "dataset": os.path.basename(indexed.prefix),
            "idx": file_stamp(indexed.idx_path),
            "bin": file_stamp(indexed.bin_path),
            "seed": seed,
            "seq_length": seq_length,
            **({"documents": list(documents)} if documents is not None else {}),
        }
        self._cache = IndexCache(cache_dir or default_cache_dir(indexed.prefix), "gpt", fields)
        arrays = self._cache.get_or_build(self._INDICES, self._build)
        self.doc_order = arrays["doc_order"]  # [docs]
        self._doc_ends = arrays["doc_ends"]  # [docs]
        self._sample_doc = arrays["sample_doc"]  # [num_samples]
        self.num_samples = len(self._sample_doc)
        self.indices_built = self._cache.built
        # Two epochs' orders suffice: a global batch straddles at most one epoch boundary.
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    def _build(self) -> dict[str, np.ndarray]:
        """The document, stream and sample indices (vectorized; memory freed after saving)."""
        (first, last), seq = self.documents, self.seq_length
        n = last - first
        self.indexed.verify()  # once per machine: later opens skip it (the key has the .idx stamp)
        order = first + seeded_rng(self.seed, _DOC_ORDER).permutation(n)
        doc_order = order.astype(_index_dtype(len(self.indexed)))
        doc_ends = np.cumsum(self.indexed.read_sizes()[doc_order], dtype=np.int64)
        total = int(doc_ends[-1]) if n else 0
        num_samples = max(total - 1, 0) // seq
        if num_samples < 1:
            raise DataFileError(
                f"{self.indexed.bin_path}: {total} tokens are too few for one sample of "
                f"model.seq_length+1 = {seq + 1} tokens. Fix: use more data or a smaller "
                f"model.seq_length"
            )
        starts = np.arange(num_samples, dtype=np.int64) * seq
        sample_doc = np.searchsorted(doc_ends, starts, side="right").astype(_index_dtype(n))
        return {"doc_order": doc_order, "doc_ends": doc_ends, "sample_doc": sample_doc}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch` (a permutation of the windows), cached per machine."""
        order = self._orders.get(epoch)
        if order is not None:
            self._orders.move_to_end(epoch)
            return order

        def build() -> dict[str, np.ndarray]:
            perm = seeded_rng(self.seed, _SAMPLE_ORDER, epoch).permutation(self.num_samples)
            return {f"shuffle{epoch}": perm.astype(_index_dtype(self.num_samples))}

        if self.num_samples < self.SHUFFLE_CACHE_MIN:
            order = build()[f"shuffle{epoch}"]
        else:
            order = self._cache.get_or_build((f"shuffle{epoch}",), build)[f"shuffle{epoch}"]
        self._orders[epoch] = order
        if len(self._orders) > 2:
            self._orders.popitem(last=False)
        return order

    def sample_index(self, i: int) -> int:
        """Position within the epoch's stream (in windows) of global sample i."""
        epoch, j = divmod(i, self.num_samples)
        return int(self._epoch_order(epoch)[j])

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of sample i: int64 [seq_length+1]."""
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        j = self.sample_index(i)
        return self._gather(int(self._sample_doc[j]), j * self.seq_length, self.seq_length + 1)

    def window(self, start: int, length: int) -> np.ndarray:
        """Stream tokens [start, start+length) gathered across documents: int64 [length]."""
        d = int(np.searchsorted(self._doc_ends, start, side="right"))
        return self._gather(d, start, length)

    def _gather(self, d: int, start: int, length: int) -> np.ndarray:
        """Stream tokens [start, start+length), the first in document position d: int64."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        while filled < length:
            doc_start = int(self._doc_ends[d - 1]) if d else 0
            offset = start + filled - doc_start
            take = min(int(self._doc_ends[d]) - doc_start - offset, length - filled)
            out[filled : filled + take] = self.indexed.get(int(self.doc_order[d]), offset, take)
            filled += take
            d += 1
        return out


def default_cache_dir(prefix: str) -> str:
    """Where a dataset's index cache lives unless data.index_cache_dir says otherwise."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index_cache")


def _index_dtype(n: int) -> type[np.integer]:
    """int32 for positions below 2**31 (half the bytes), else int64."""
    return np.int32 if n < 2**31 else np.int64


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
        rng = seeded_rng(self.seed, _MOCK, i)
        return rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
