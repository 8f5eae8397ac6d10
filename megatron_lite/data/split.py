"""data.split: each dataset's documents cut into train, valid and test parts, and the rule that
every part a run reads holds at least one sample, with a split that works as the fix.

All of it reads two index entries per part (`IndexedDataset.tokens_between`), never the
document sizes: the check costs the same on a 50M-document corpus as on a small one.
"""

from __future__ import annotations

from megatron_lite.data.errors import DataFileError
from megatron_lite.resolve import split_weights

PARTS = ("training", "validation", "test")


def split_documents(num_docs: int, split: str | None) -> list[tuple[int, int]]:
    """[first, last) document ranges of the train, valid and test parts (Megatron's
    "969,30,1": weights normalized, boundaries rounded)."""
    if split is None:
        return [(0, num_docs), (num_docs, num_docs), (num_docs, num_docs)]
    bounds, acc = [0], 0.0
    for w in split_weights(split):
        acc += w
        bounds.append(round(acc * num_docs))
    bounds[-1] = num_docs
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _short_part(indexed, split: str, seq: int, parts: tuple[int, ...]):
    """The first (dataset, part, documents, tokens) whose part holds no whole sample of
    seq + 1 tokens, or None."""
    for ds in indexed:
        ranges = split_documents(len(ds), split)
        for part in parts:
            tokens = ds.tokens_between(*ranges[part])
            if tokens < seq + 1:
                return ds, part, ranges[part], tokens
    return None


def _validation_docs(ds, seq: int) -> int | None:
    """The fewest documents at the end of `ds` that hold a sample, leaving a sample before
    them; None when the dataset cannot hold two samples."""
    n = len(ds)
    lo, hi = 1, n - 1  # binary search: the tail's tokens grow with its documents
    if hi < 1 or ds.tokens_between(n - hi, n) < seq + 1:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ds.tokens_between(n - mid, n) < seq + 1 else (lo, mid)
    return lo if ds.tokens_between(0, n - lo) >= seq + 1 else None


def working_split(indexed, seq: int) -> str | None:
    """A data.split "train,valid,0" whose training and validation parts hold a sample in every
    dataset (checked), giving validation the smallest share; None when there is none."""
    need = []
    for ds in indexed:
        k = _validation_docs(ds, seq)
        if k is None:
            return None
        need.append((k / len(ds), k, len(ds)))
    _, k, n = max(need)
    for extra in range(4):  # rounding the other datasets' boundaries can cost a document
        split = f"{n - k - extra},{k + extra},0"
        if n - k - extra >= 1 and _short_part(indexed, split, seq, (0, 1)) is None:
            return split
    return None


def check_split(indexed, split: str | None, seq: int, evaluating: bool) -> None:
    """DataFileError naming data.split when the training part (or, when `evaluating`, the
    validation part) of a dataset is too short for one sample of seq + 1 tokens."""
    if split is None:
        return
    short = _short_part(indexed, split, seq, (0, 1) if evaluating else (0,))
    if short is None:
        return
    ds, part, (first, last), tokens = short
    if not evaluating:
        fix = "data.split=null (evaluation is off: every document trains)"
    else:
        works = working_split(indexed, seq)
        fix = "data.valid_paths with separate validation data"
        if works is not None:
            fix = f'data.split="{works}" (the smallest validation share that works), or {fix}'
        else:
            fix += ", more data, or a smaller model.seq_length"
    raise DataFileError(
        f"data.split={split!r}: the {PARTS[part]} part of {ds.prefix} is its documents "
        f"[{first}, {last}) of {len(ds)}, {tokens} tokens: too few for one sample of "
        f"model.seq_length+1 = {seq + 1}. Fix: {fix}"
    )
