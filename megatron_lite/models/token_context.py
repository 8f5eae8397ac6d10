"""`TokenContext`: what every layer of one microbatch needs besides the hidden state."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenContext:
    """Built once per microbatch by `ModelChunk.token_context` and passed to every layer (and
    through full recompute as an argument, so a rerun sees this microbatch's tensors).

    rope: cos, sin of this rank's tokens: [s/cp, r] shared by the batch, or [s/cp, b, r] with
        data.reset_position_ids (r: the attention part's rotary width); None without RoPE.
    docs: document ids [b, s] of the full sequence (data.reset_attention_mask: attention stays
        inside a document), None for plain causal attention.
    positions: each local token's position in its document [s/cp, b] (data.reset_position_ids,
        read by GPT's learned position embedding), None for consecutive positions.
    """

    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    docs: torch.Tensor | None = None
    positions: torch.Tensor | None = None
