"""Documents of packed sequences: ids, per-document positions and the causal document mask.

A packed window holds several documents separated by end-of-document (EOD) tokens. The EOD
token belongs to the document it ends and the token after it starts the next one, as in
Megatron's get_ltor_masks_and_position_ids: the document id of position t is the number of EOD
tokens among tokens[0..t-1]. Pure functions of token ids and positions (no process groups), so
every context-parallel scheme can build its mask from the global positions it holds.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """tokens [b, s] -> document id of each position [b, s] (exclusive cumsum of EODs)."""
    eod = (tokens == eod_id).long()
    return eod.cumsum(dim=1) - eod


def document_position_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """tokens [b, s] -> each token's position within its document [b, s] (0 at every start)."""
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).expand(b, s)
    # a document starts at 0 or right after an EOD: the latest start at or before t
    starts = torch.zeros_like(tokens, dtype=torch.long)
    starts[:, 1:] = torch.where(tokens[:, :-1] == eod_id, pos[:, 1:], 0)
    return pos - starts.cummax(dim=1).values


def causal_document_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys each query may attend (True = attend): [b or 1, 1, sq, sk] bool.

    q_pos [sq] / k_pos [sk]: global sequence positions of the queries and keys held (any order:
    context parallelism hands ranks permuted chunks); q_doc [b, sq] / k_doc [b, sk]: their
    document ids, or None for plain causal attention. mask = (k_pos <= q_pos) & (k_doc == q_doc).
    """
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, sq, sk]
    if q_doc is None or k_doc is None:
        if q_doc is not None or k_doc is not None:
            raise ValueError("causal_document_mask: give both q_doc and k_doc, or neither")
        return mask
    same = k_doc[:, None, None, :] == q_doc[:, None, :, None]  # [b, 1, sq, sk]
    return mask & same
