"""Blending several sample datasets by weight, with O(1) lookup of any blended sample.

Megatron's greedy: sample n goes to the dataset whose achieved count lags its target
w_k·(n+1) the most (ties to a seeded order of the datasets) and takes that dataset's next
sample. With the weights as integers q_k summing to a period D (w_k = q_k / D), the greedy runs
on exact integer deficits q_k·t - D·c_k, and after D samples every dataset has had exactly q_k
(the greedy keeps each count within one sample of its target, so at t = D every deficit is 0;
building the period checks it): the sequence is periodic. One period is computed once (and
cached like the other indices), and sample i is period p = i // D, position r = i % D: dataset
choice[r], its sample p·q_k + index[r]. Resuming at sample 10^9 costs what sample 0 costs.

Weights that are simple fractions (0.5/0.3/0.2 -> D = 10, 1:2 -> D = 3) are exact; others are
rounded to D = MAX_PERIOD (2^18) by largest remainders, so each weight is within 2^-19 of the
requested one, and a positive weight never rounds to 0.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from megatron_lite.data.gpt_dataset import BLEND_STREAM, seeded_rng
from megatron_lite.data.index_cache import IndexCache

MAX_PERIOD = 1 << 18


def period_weights(weights: np.ndarray, max_period: int | None = None) -> np.ndarray:
    """Integer weights q (int64 [K], sum = the period D <= max_period, default MAX_PERIOD)."""
    max_period = max_period or MAX_PERIOD
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    fractions = [Fraction(float(x)).limit_denominator(max_period) for x in w]
    period = math.lcm(*(f.denominator for f in fractions))
    if period <= max_period and sum(fractions) == 1:
        return np.array([int(f * period) for f in fractions], dtype=np.int64)
    scaled = w * max_period
    q = np.floor(scaled).astype(np.int64)
    short = max_period - int(q.sum())
    q[np.argsort(-(scaled - q), kind="stable")[:short]] += 1  # largest remainders
    for k in np.flatnonzero((q == 0) & (w > 0)):  # keep every positive weight in the mix
        q[int(np.argmax(q))] -= 1
        q[k] = 1
    return q


def greedy_period(q: np.ndarray, tie_order: np.ndarray) -> dict[str, np.ndarray]:
    """One period of the greedy: dataset `choice` int16 [D] and its running `index` int32 [D].

    A scalar loop over D steps on exact integers (a few hundred ms at D = 2^18, once per
    machine); the per-dataset running indices are then computed vectorized.
    """
    period, k_count = int(q.sum()), len(q)
    order = [int(k) for k in tie_order]
    step = [int(q[k]) for k in order]  # deficits kept in tie order: max() takes the first
    deficit = [0] * k_count
    picks = np.empty(period, dtype=np.int16)
    for t in range(period):
        deficit = [d + s for d, s in zip(deficit, step, strict=True)]
        pos = deficit.index(max(deficit))
        deficit[pos] -= period
        picks[t] = pos
    if any(deficit):  # the sequence would not repeat (never seen; checked, not assumed)
        raise RuntimeError(f"greedy blend of weights {q.tolist()} is not periodic")
    choice = np.asarray(order, dtype=np.int16)[picks]
    index = np.empty(period, dtype=np.int32)
    for k in range(k_count):
        at = np.flatnonzero(choice == k)
        index[at] = np.arange(len(at), dtype=np.int32)
    return {"choice": choice, "index": index}


class BlendedDataset:
    """Mixes datasets so that the share of samples from each tracks its weight (see module).

    `cache_dir` keeps the period's arrays as memory-mapped `.npy` (built once per machine);
    without it they are built in memory (at most 1.5 MiB).
    """

    def __init__(
        self, datasets: list, weights: list[float], seed: int, cache_dir: str | None = None
    ):
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
        self.q = period_weights(w)  # [K], sum = period
        self.period = int(self.q.sum())
        tie_order = seeded_rng(seed, BLEND_STREAM).permutation(len(datasets))

        def build() -> dict[str, np.ndarray]:
            return greedy_period(self.q, tie_order)

        if cache_dir is None:
            arrays, self.indices_built = build(), True
        else:
            fields = {"q": self.q.tolist(), "tie_order": tie_order.tolist()}
            cache = IndexCache(cache_dir, "blend", fields)
            arrays = cache.get_or_build(("choice", "index"), build)
            self.indices_built = cache.built
        self._choice, self._index = arrays["choice"], arrays["index"]  # [period] each

    def locate(self, i: int) -> tuple[int, int]:
        """(dataset k, index into dataset k) of blended sample i, in O(1)."""
        p, r = divmod(i, self.period)
        k = int(self._choice[r])
        return k, p * int(self.q[k]) + int(self._index[r])

    def locate_many(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorized `locate`: (datasets int64 [n], indices into them int64 [n])."""
        p, r = np.divmod(np.asarray(indices, dtype=np.int64), self.period)
        k = self._choice[r].astype(np.int64)
        return k, p * self.q[k] + self._index[r]

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of blended sample i: int64 [seq_length+1]."""
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        k, j = self.locate(i)
        return self.datasets[k][j]
