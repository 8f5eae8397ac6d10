"""Document ids, positions and masks of packed sequences (context/documents.py) against a plain
Python loop of Megatron's get_ltor_masks_and_position_ids (reset_attention_mask and
reset_position_ids), on random rows with EODs at the first and last positions and in a row."""

import pytest
import torch

from megatron_lite.context.documents import (
    causal_document_mask,
    document_ids,
    document_position_ids,
)

EOD = 7


def megatron_reference(row: list[int], eod: int):
    """Megatron's loop for one row: the causal mask with mask[i+1:, :i+1] = 0 and
    position_ids[i+1:] -= i+1-prev at every EOD index i (prev: the previous document's start)."""
    s = len(row)
    mask = [[k <= q for k in range(s)] for q in range(s)]
    position_ids = list(range(s))
    prev = 0
    for i in [j for j, t in enumerate(row) if t == eod]:
        for q in range(i + 1, s):
            for k in range(i + 1):
                mask[q][k] = False
            position_ids[q] -= i + 1 - prev
        prev = i + 1
    return torch.tensor(mask), torch.tensor(position_ids)


def rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    out = torch.randint(0, 10, (6, 17), generator=g)  # EOD = 7: about one token in ten
    out[0, 0] = EOD  # first position
    out[1, -1] = EOD  # last position
    out[2, 4:7] = EOD  # consecutive EODs: one-token documents
    out[3] = EOD  # every token its own document
    out[4] = torch.where(out[4] == EOD, 0, out[4])  # no EOD: one document
    return out


def test_ids_positions_and_mask_match_megatron():
    tokens = rows()
    docs, pos = document_ids(tokens, EOD), document_position_ids(tokens, EOD)
    s = tokens.shape[1]
    mask = causal_document_mask(torch.arange(s), torch.arange(s), docs, docs)
    assert mask.shape == (tokens.shape[0], 1, s, s) and mask.dtype == torch.bool
    for r, row in enumerate(tokens.tolist()):
        want_mask, want_pos = megatron_reference(row, EOD)
        assert torch.equal(pos[r], want_pos), f"row {r}: positions {pos[r]} != {want_pos}"
        assert torch.equal(mask[r, 0], want_mask), f"row {r} ({row}): the masks differ"
    assert torch.equal(docs[3], torch.arange(s)) and docs[4].eq(0).all()
    assert docs[0, 0] == 0 and docs[0, 1] == 1, "the EOD belongs to the document it ends"


def test_permuted_positions_give_the_permuted_mask():
    """Context parallelism hands a rank chunks out of order: the mask follows the positions."""
    tokens = rows()
    s = tokens.shape[1]
    docs = document_ids(tokens, EOD)
    full = causal_document_mask(torch.arange(s), torch.arange(s), docs, docs)
    q, k = torch.randperm(s, generator=torch.Generator().manual_seed(1)), torch.arange(s).flip(0)
    got = causal_document_mask(q, k, docs[:, q], docs[:, k])
    assert torch.equal(got, full[:, :, q][:, :, :, k])


def test_plain_causal_without_documents():
    s = 5
    mask = causal_document_mask(torch.arange(s), torch.arange(s))
    assert mask.shape == (1, 1, s, s)
    assert torch.equal(mask[0, 0], torch.ones(s, s, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="both"):
        causal_document_mask(torch.arange(s), torch.arange(s), torch.zeros(1, s), None)
