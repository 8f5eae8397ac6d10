"""The language-model forward step the pipeline engine runs for every (microbatch, chunk).

A microbatch is token ids [b, s + 1] (the sample contract, `data.sampler.split_sample`): the
first stage embeds the inputs, the last one returns the summed per-token loss against the labels
(with multi-token prediction, carrying the MTP objective's gradient: `with_mtp_objective`).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_lite.data.sampler import split_sample
from megatron_lite.pipeline.engine import ForwardStep


def autocast(precision: str, device: torch.device):
    """bf16 autocast for train.precision=bf16, nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_forward_step(
    precision: str, device: torch.device, eod_mask_id: int | None = None
) -> ForwardStep:
    """forward_step(chunk, sample [b, s + 1], input) for `ModelChunk`s: the hidden state
    [s/cp(/tp), b, h] for the next stage, or on the last stage the loss summed over this rank's
    tokens (unscaled; the engine scales it for backward). Every chunk gets the token ids (its
    documents' masks and positions); `eod_mask_id`: split_sample's."""

    def forward_step(chunk, sample: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        tokens, labels = split_sample(sample, eod_mask_id)  # [b, s] each
        with autocast(precision, device):
            labels = labels if chunk.post_process else None
            out = chunk(tokens if x is None else x, labels, tokens=tokens)
        if not chunk.post_process:
            return out
        if isinstance(out, tuple):  # multi-token prediction: (loss, MTP losses [D, s/cp, b])
            return with_mtp_objective(*out, chunk.mtp.loss_scale)
        return out.sum()  # per-token loss [s/cp, b] summed

    return forward_step


def with_mtp_objective(loss: torch.Tensor, mtp: torch.Tensor, scale: float) -> torch.Tensor:
    """The summed main loss, whose backward also trains `scale` · Σ mtp (models/mtp.py: scale
    = λ/D, and the engine's 1/N applies to both): the value is the main loss's sum bitwise (the
    MTP term enters as o - o.detach(), an exact zero), so the logged loss stays the LM loss."""
    objective = mtp.sum() * scale
    return loss.sum() + (objective - objective.detach())
