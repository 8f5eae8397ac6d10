"""Autoregressive decoding on one model chunk that holds the whole model (pp=1, cp=1; any tp):
the prompts' forward fills a `KVCache` (models/attention.py), then each step feeds one token
per row. Prompts of different lengths share a batch left-padded: each row's positions start
at 0 at its first real token and the mask hides the padding, so a row decodes as it would
alone (to float rounding). Every TP rank computes the same gathered logits and draws the same
token (one seeded generator each); TP rank 0's choice is broadcast so they never drift.

`kv_cache=False` recomputes each row's whole sequence at every step through the training
forward (plain causal attention, no cache, no padding): the reference the cache is tested
against, and a fallback to rule the cache out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_lite.models.attention import DecodeContext, KVCache
from megatron_lite.models.token_context import TokenContext
from megatron_lite.moe.layer import moe_layers
from megatron_lite.parallel import mappings
from megatron_lite.parallel.mesh import Group

__all__ = ["Sampling", "generate", "next_tokens"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax, first index on ties); else softmax(logits / temperature)
    restricted to the top_k most likely tokens (0: all) and to the smallest set whose
    probability reaches top_p (1: all), drawn from a generator seeded with `seed`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
    """logits [b, V] (fp32) -> the next token of each row [b]."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # drop a token when the more likely ones already reach top_p (the first always stays)
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _last_logits(chunk, tp: Group, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Hidden states [s, b, h] -> the last position's logits [b, V] (fp32, gathered over TP,
    the vocabulary padding dropped)."""
    logits = chunk.logits(chunk.final_norm(x[-1:]))  # [1, b, V/tp]
    logits = mappings.gather_from_tensor_parallel_region(logits, tp.group)  # [1, b, V_padded]
    for moe in moe_layers([chunk]):  # routing statistics are the trainer's: not kept here
        moe.pop_stats()
    return logits[0, :, :vocab_size].float()


def cached_step(chunk, tp: Group, ids, positions, cache: KVCache, mask, vocab_size: int):
    """One forward of ids [b, s] at positions [s, b] over the cache (which it extends by s)
    -> the last position's logits [b, V]."""
    ctx = DecodeContext(chunk.rope_at(positions), None, positions, kv_cache=cache, mask=mask)
    x = chunk.embed(ids, positions)  # [s, b, h]
    with chunk.fp8():
        x = chunk.run_layers(x, ctx)
    cache.advance(ids.shape[1])
    return _last_logits(chunk, tp, x, vocab_size)


def full_step(chunk, tp: Group, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The training forward of whole sequences ids [b, s] (no cache, no padding) -> the last
    position's logits [b, V]."""
    s, b = ids.shape[1], ids.shape[0]
    positions = torch.arange(s, device=ids.device)[:, None].expand(s, b)
    rope = chunk.rope_at(torch.arange(s, device=ids.device))  # [s, r]
    x = chunk.embed(ids, positions)
    with chunk.fp8():
        x = chunk.run_layers(x, TokenContext(rope, None, positions))
    return _last_logits(chunk, tp, x, vocab_size)


def _mask(valid: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """[b, 1, end - start, end]: query slot i (start <= i < end) sees key slot j <= i of its
    row when j holds a real token; a padding query sees itself (no empty softmax row)."""
    q = torch.arange(start, end, device=valid.device)[:, None]  # [s, 1]
    k = torch.arange(end, device=valid.device)[None, :]  # [1, end]
    allowed = ((k <= q) & valid[:, None, :end]) | (k == q)  # [b, s, end]
    return allowed[:, None]


def generate(
    chunk,
    tp: Group,
    prompts: list[list[int]],
    max_new_tokens: int,
    vocab_size: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    kv_cache: bool = True,
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """Up to max_new_tokens new tokens after each prompt (token ids), every row stopping after
    it produced eos_id; on_token(row, id) sees each new token as it is chosen (in step order).
    Collective over `tp`: every rank of it calls this with the same arguments."""
    b, lengths = len(prompts), [len(p) for p in prompts]
    longest = max(lengths)
    total = longest + max_new_tokens
    pad = torch.tensor([longest - n for n in lengths], device=device)  # [b]
    ids = torch.zeros(b, longest, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
    valid = torch.arange(total, device=device)[None, :] >= pad[:, None]  # [b, total]
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    cache = KVCache(total)
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    step_ids = ids
    for _ in range(max_new_tokens):
        start = cache.length
        end = start + step_ids.shape[1]
        if kv_cache:
            positions = (torch.arange(start, end, device=device)[:, None] - pad).clamp(min=0)
            mask = _mask(valid, start, end)
            logits = cached_step(chunk, tp, step_ids, positions, cache, mask, vocab_size)
        else:  # each row alone, its whole sequence so far
            rows = [ids[r : r + 1, pad[r] :] for r in range(b)]
            logits = torch.cat([full_step(chunk, tp, row, vocab_size) for row in rows])
            cache.advance(step_ids.shape[1])
        chosen = next_tokens(logits, sampling, generator)  # [b]
        if tp.size > 1:  # the same on every TP rank already; TP rank 0's rules regardless
            dist.broadcast(chosen, src=tp.ranks[0], group=tp.group)
        for row in range(b):
            if not done[row]:
                out[row].append(int(chosen[row]))
                done[row] = int(chosen[row]) == eos_id
                if on_token is not None:
                    on_token(row, int(chosen[row]))
        if all(done):
            break
        step_ids = chosen[:, None]
        ids = torch.cat([ids, step_ids], dim=1)
    return out
