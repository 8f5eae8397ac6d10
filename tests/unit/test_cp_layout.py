"""Which positions each CP rank holds (context/layout.py): a partition of the sequence, the
pieces Ulysses concatenates back into its ring rank's tokens, and causal work per ring rank
counted pair by pair."""

import pytest
import torch

from megatron_lite.context.layout import cp_ranges, positions, ring_ranges


@pytest.mark.parametrize("s,a2a,ring", [(32, 1, 4), (32, 2, 2), (48, 3, 2), (32, 4, 1), (64, 2, 4)])
def test_every_position_once_and_ulysses_reassembles_the_ring_rank(s, a2a, ring):
    cp = a2a * ring
    held = [positions(cp_ranges(s, a2a, ring, r)) for r in range(cp)]
    assert all(len(h) == s // cp for h in held)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(s))
    for j, mine in enumerate(ring_ranges(s, ring)):
        # Ulysses' all-to-all concatenates its a2a ranks' tokens in rank order
        gathered = torch.cat(held[j * a2a : (j + 1) * a2a])
        assert torch.equal(gathered, positions(mine)), (j, gathered, positions(mine))


def _causal_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    return int((k_pos[None, :] <= q_pos[:, None]).sum())


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_balanced_ring_ranks_attend_to_equal_numbers_of_pairs(ring):
    s = 16 * ring
    rings = ring_ranges(s, ring)
    everything = torch.arange(s)
    pairs = [_causal_pairs(positions(r), everything) for r in rings]
    assert len(set(pairs)) == 1, pairs  # exactly equal causal work
    naive = [_causal_pairs(positions(r), everything) for r in ring_ranges(s, ring, False)]
    assert naive == sorted(naive) and naive[-1] > naive[0], naive


def test_uneven_splits_are_refused():
    with pytest.raises(ValueError, match="2·ring chunks"):
        ring_ranges(30, 4)
