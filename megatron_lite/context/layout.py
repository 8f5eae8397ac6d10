"""Which global sequence positions each context-parallel (CP) rank holds.

Every CP type is one rule with two degrees: `a2a` ranks exchange heads by all-to-all (Ulysses)
and `ring` ranks pass K/V blocks around a ring (cp = a2a · ring; `a2a` is ring = 1, `p2p` is
a2a = 1). The sequence is cut into 2·ring equal chunks and ring rank j owns chunks j and
2·ring−1−j, so under the causal mask every ring rank has the same attention work (Megatron's
and TorchTitan's head-tail load balancing); ring = 1 owns the whole sequence. The a2a ranks of
ring rank j split its token list into `a2a` contiguous parts, in a2a-rank order, which is what
the Ulysses all-to-all concatenates back. CP rank = ring rank · a2a + a2a rank (mesh.py).

Positions are returned as [start, end) ranges in local order; RoPE, the position embeddings,
the labels and the attention masks all read them.
"""

from __future__ import annotations

import torch

Ranges = tuple[tuple[int, int], ...]


def ring_ranges(seq_length: int, ring: int, balanced: bool = True) -> list[Ranges]:
    """Each ring rank's global positions: chunks j and 2·ring−1−j of 2·ring (balanced), or the
    j-th contiguous 1/ring (the naive split, kept for comparison)."""
    if ring == 1:
        return [((0, seq_length),)]
    if not balanced:
        n = _exact(seq_length, ring, "ring ranks")
        return [((j * n, (j + 1) * n),) for j in range(ring)]
    c = _exact(seq_length, 2 * ring, "2·ring chunks")
    return [
        ((j * c, (j + 1) * c), ((2 * ring - 1 - j) * c, (2 * ring - j) * c)) for j in range(ring)
    ]


def split_ranges(ranges: Ranges, parts: int) -> list[Ranges]:
    """`ranges` (in order) cut into `parts` contiguous pieces of equal length."""
    total = sum(e - s for s, e in ranges)
    n = _exact(total, parts, "parts")
    out, cur, need = [], [], n
    for s, e in ranges:
        while s < e:
            take = min(e - s, need)
            cur.append((s, s + take))
            s, need = s + take, need - take
            if need == 0:
                out.append(tuple(cur))
                cur, need = [], n
    return out


def cp_ranges(seq_length: int, a2a: int, ring: int, cp_rank: int, balanced: bool = True) -> Ranges:
    """The global positions CP rank `cp_rank` holds (ring rank cp_rank // a2a, a2a rank
    cp_rank % a2a)."""
    mine = ring_ranges(seq_length, ring, balanced)[cp_rank // a2a]
    return split_ranges(mine, a2a)[cp_rank % a2a]


def positions(ranges: Ranges, device=None) -> torch.Tensor:
    """The positions of `ranges` as one LongTensor [n]."""
    return torch.cat([torch.arange(s, e, device=device) for s, e in ranges])


def _exact(n: int, k: int, what: str) -> int:
    if n % k:
        raise ValueError(f"context parallel: {n} tokens do not split into {k} {what}")
    return n // k
