"""Indexed memory-mapped token datasets: a `.bin` of raw tokens and an `.idx` that indexes it.

Layout (little-endian), close to Megatron's MMIDIDX format with the same dtype codes:

    .idx  magic b"MLITEIDX" | version u64 | dtype code u8 | document count u64 |
          max token id i64 (-1 when empty) | token counts i32[n] | byte offsets i64[n]
    .bin  the documents' tokens back to back, uint16 when the vocabulary is < 65500, else int32

Both files are memory-mapped, never read into memory: opening checks the index in bounded-size
chunks and afterwards `sizes`/`offsets` are views of the mapping.

The maximum token id lets `build_dataset` check the model's vocabulary without reading `.bin`;
a sidecar `<prefix>.maxid.json` (see `token_ids`) proves on each open, from a fingerprint of
the `.bin`, that the `.bin` still holds ids in that range (an older dataset without the sidecar,
or a `.bin` changed since, is scanned once). A `.bin` whose ids disagree with its index is
rejected.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from megatron_lite.data import token_ids
from megatron_lite.data.errors import DataFileError

_MAGIC = b"MLITEIDX"
_VERSION = 1
# magic, version, dtype code, document count, max token id
_HEADER = struct.Struct("<8sQBQq")
# Megatron's dtype codes, so a reader coming from Megatron recognises them.
_DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_CODE_OF = {np.dtype(t): code for code, t in _DTYPE_CODES.items()}
# Documents per chunk of the .idx consistency check (12 bytes each).
_CHECK_CHUNK = 1 << 22
_FIX = "re-run tools/preprocess_data.py to rebuild the .bin/.idx pair"


def best_dtype(vocab_size: int) -> type[np.integer]:
    """Smallest token dtype for a vocabulary: uint16 below 65500 tokens, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetBuilder:
    """Writes an indexed dataset at `prefix` (.bin/.idx) one document at a time.

    Tokens go to temporary files beside the target; `finalize()` renames them into place, so an
    interrupted build leaves no dataset and an existing one stays intact until the new one is
    complete. As a context manager, an exception discards the temporary files and a clean exit
    finalizes.
    """

    def __init__(self, prefix: str, dtype: type[np.integer] | np.dtype = np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}; use uint16 or int32")
        self._made_dirs = _make_parents(os.path.dirname(os.path.abspath(prefix)))
        # The pid keeps concurrent writers of the same prefix from sharing temporaries.
        tag = f".tmp.{os.getpid()}"
        self._tmp_bin, self._tmp_idx = prefix + ".bin" + tag, prefix + ".idx" + tag
        self._bin = open(self._tmp_bin, "wb")
        self._sizes: list[int] = []
        self._min_id, self._max_id = 0, -1
        self._closed = False

    @property
    def max_token_id(self) -> int:
        """Largest token id added so far (-1 before any token)."""
        return self._max_id

    def add_document(self, tokens) -> None:
        """Append one document: a 1-D sequence of non-negative token ids that fit the dtype."""
        if self._closed:
            raise RuntimeError(f"builder for {self.prefix!r} is already finalized or aborted")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D token ids, got shape {arr.shape}")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            info = np.iinfo(self.dtype)
            if lo < 0 or hi > info.max:
                raise ValueError(
                    f"token ids must lie in [0, {info.max}] for dtype {self.dtype}, got "
                    f"[{lo}, {hi}]; build with dtype=int32 for vocabularies of 65500 or more"
                )
            self._min_id = lo if self._max_id < 0 else min(self._min_id, lo)
            self._max_id = max(self._max_id, hi)
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(int(arr.size))

    def finalize(self) -> None:
        """Write the index and move both files into place (.bin first, then .idx)."""
        if self._closed:
            raise RuntimeError(f"builder for {self.prefix!r} is already finalized or aborted")
        try:
            sizes = np.asarray(self._sizes, dtype=np.int32)
            offsets = np.zeros(len(sizes), dtype=np.int64)
            np.cumsum(sizes[:-1], dtype=np.int64, out=offsets[1:])
            offsets *= self.dtype.itemsize
            header = _HEADER.pack(_MAGIC, _VERSION, _CODE_OF[self.dtype], len(sizes), self._max_id)
            with open(self._tmp_idx, "wb") as f:
                f.write(header + sizes.tobytes() + offsets.tobytes())
                f.flush()
                os.fsync(f.fileno())
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            # The .idx goes last: a reader never sees a new index over an old .bin.
            os.replace(self._tmp_bin, self.prefix + ".bin")
            os.replace(self._tmp_idx, self.prefix + ".idx")
        except BaseException:
            self.abort()
            raise
        self._closed = True
        token_ids.write_sidecar(self.prefix, self.prefix + ".bin", self._min_id, self._max_id)

    def abort(self) -> None:
        """Discard the temporary files; the target prefix is left as it was."""
        self._closed = True
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        for path in reversed(self._made_dirs):  # deepest first; only those still empty
            try:
                os.rmdir(path)
            except OSError:
                break

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.finalize()


class IndexedDataset:
    """Read-only view of an indexed dataset; documents come back as numpy views of the mmap.

    Opening validates the pair and raises `DataFileError` (naming the file, the rule and the fix)
    for a missing file, a foreign or newer index, or a `.bin` whose size disagrees with the index.
    `sizes` and `offsets` are views of the memory-mapped `.idx`, never copied into memory:
    indexing them costs a page, not the corpus. `verify=False` skips the full check of the
    offsets (O(documents) reads), leaving the O(1) ones: the index builders (`GPTDataset`) run
    `verify()` once per machine when they build, and their cache key holds the `.idx`'s size
    and mtime, so every rank of every later start opens in constant time.
    """

    def __init__(self, prefix: str, verify: bool = True):
        self.prefix = prefix
        self.idx_path, self.bin_path = prefix + ".idx", prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise DataFileError(
                    f"{path}: file does not exist. Fix: {_FIX}, or correct the "
                    f"dataset prefix {prefix!r}"
                )
        self.dtype, self.sizes, self.offsets, self.max_token_id = _read_index(self.idx_path)
        if verify:
            self.num_tokens = self.verify()
        else:  # from the last entry; verify() (run by the index builders) checks the rest
            self.num_tokens = self.tokens_between(0, len(self.sizes))
        expected = self.num_tokens * self.dtype.itemsize
        actual = os.path.getsize(self.bin_path)
        if actual != expected:
            raise DataFileError(
                f"{self.bin_path}: holds {actual} bytes but {self.idx_path} describes "
                f"{self.num_tokens} tokens of {self.dtype} = {expected} bytes, so the .bin is "
                f"truncated or belongs to another index. Fix: {_FIX}"
            )
        self._tokens = _map_tokens(self.bin_path, self.dtype)
        self._check_token_ids()

    def verify(self) -> int:
        """Check every size and offset of the `.idx` (12 bytes a document, read in chunks, the
        mapping untouched); return the token count. DataFileError if they disagree."""
        with open(self.idx_path, "rb") as f:
            return _check_offsets(self.idx_path, f.fileno(), len(self.sizes), self.dtype.itemsize)

    def _check_token_ids(self) -> None:
        """The .bin's real id range (see `token_ids`) must be the one the index records."""
        lo, hi = token_ids.token_id_range(self.prefix, self.bin_path, self._tokens)
        if lo < 0 or hi != self.max_token_id:
            raise DataFileError(
                f"{self.bin_path}: holds token ids {lo}..{hi}, but {self.idx_path} records "
                f"{self.max_token_id} as the largest id, so the .bin was changed after "
                f"preprocessing or belongs to another dataset (ids beyond the vocabulary "
                f"would train as garbage). Fix: {_FIX}"
            )

    def __len__(self) -> int:
        return len(self.sizes)

    def contains(self, token: int) -> bool:
        """Whether the `.bin` holds `token` anywhere: O(1) above the largest id, else a scan
        in growing chunks that stops at the first hit (one small read where every document
        ends with it; the whole `.bin` once where it is absent)."""
        if not 0 <= token <= self.max_token_id:
            return False
        start, chunk = 0, 1 << 16
        while start < self._tokens.size:
            if (self._tokens[start : start + chunk] == token).any():
                return True
            start, chunk = start + chunk, min(chunk * 4, 1 << 26)
        return False

    def tokens_between(self, first: int, last: int) -> int:
        """Tokens of documents [first, last), from two index entries (O(1))."""
        if last <= first:
            return 0
        end = int(self.offsets[last - 1]) // self.dtype.itemsize + int(self.sizes[last - 1])
        return end - int(self.offsets[first]) // self.dtype.itemsize

    def read_sizes(self) -> np.ndarray:
        """A private in-memory copy of the token counts, int32 [n] (for index builders: reading
        the file does not leave the mapping's pages resident in this process)."""
        return np.fromfile(self.idx_path, np.int32, count=len(self.sizes), offset=_HEADER.size)

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of document i, shape [sizes[i]] (a read-only view)."""
        n = len(self.sizes)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents in {self.prefix}")
        return self.get(i % n)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of document `doc` (to its end if length is None)."""
        size = int(self.sizes[doc])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for document "
                f"{doc} of {size} tokens in {self.prefix}"
            )
        start = int(self.offsets[doc]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]


def _make_parents(path: str) -> list[str]:
    """os.makedirs(path), returning the directories it created, outermost first."""
    missing = []
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.makedirs(directory, exist_ok=True)
    return missing[::-1]


def _read_index(path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, int]:
    """Check an .idx file's header and size and map it: (dtype, token counts i32[n], byte offsets
    i64[n], max id), the arrays being views of a read-only mmap."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != _MAGIC:
            raise DataFileError(
                f"{path}: not a megatron_lite index (bad magic header). Fix: {_FIX}"
            )
        _, version, code, n, max_id = _HEADER.unpack(head)
        if version != _VERSION:
            raise DataFileError(
                f"{path}: index version {version}, this reader understands "
                f"version {_VERSION}. Fix: {_FIX}"
            )
        if code not in _DTYPE_CODES:
            raise DataFileError(f"{path}: unknown token dtype code {code}. Fix: {_FIX}")
        body = os.fstat(f.fileno()).st_size - _HEADER.size
        if body != n * (4 + 8):
            raise DataFileError(
                f"{path}: header says {n} documents ({n * 12} index bytes) but "
                f"{body} bytes follow, so the index is truncated or "
                f"corrupt. Fix: {_FIX}"
            )
        dtype = np.dtype(_DTYPE_CODES[code])
        if n == 0:
            return dtype, np.empty(0, np.int32), np.empty(0, np.int64), int(max_id)
        buf = random_access_mmap(f.fileno())
    sizes = np.frombuffer(buf, dtype=np.int32, count=n, offset=_HEADER.size)
    offsets = np.frombuffer(buf, dtype=np.int64, count=n, offset=_HEADER.size + 4 * n)
    return dtype, sizes, offsets, int(max_id)


def _check_offsets(path: str, fd: int, n: int, itemsize: int) -> int:
    """Sizes >= 0 and offsets == their running sum (in bytes), chunk by chunk: the token count."""
    total = 0
    for start in range(0, n, _CHECK_CHUNK):
        count = min(_CHECK_CHUNK, n - start)
        sizes = np.frombuffer(os.pread(fd, 4 * count, _HEADER.size + 4 * start), np.int32)
        offsets = np.frombuffer(os.pread(fd, 8 * count, _HEADER.size + 4 * n + 8 * start), np.int64)
        expected = np.empty(count, dtype=np.int64)
        expected[0] = total
        np.cumsum(sizes[:-1], dtype=np.int64, out=expected[1:])
        expected[1:] += total
        if (sizes < 0).any() or not np.array_equal(offsets, expected * itemsize):
            raise DataFileError(
                f"{path}: document sizes and byte offsets disagree, so the index is "
                f"corrupt. Fix: {_FIX}"
            )
        total = int(expected[-1]) + int(sizes[-1])
    return total


def _map_tokens(path: str, dtype: np.dtype) -> np.ndarray:
    """The whole .bin as a read-only flat array backed by mmap (empty files cannot be mapped)."""
    if os.path.getsize(path) == 0:
        return np.empty(0, dtype=dtype)
    with open(path, "rb") as f:
        buf = random_access_mmap(f.fileno())
    return np.frombuffer(buf, dtype=dtype)


def random_access_mmap(fd: int) -> mmap.mmap:
    """A read-only map of the whole file, advised for random access: a sample touches a few
    pages, and without the advice each fault reads ahead (and keeps resident) megabytes."""
    buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        buf.madvise(mmap.MADV_RANDOM)
    return buf
