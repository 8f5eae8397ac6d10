"""All-to-all token dispatcher over the expert-parallel group.

dispatch: permute the kept (token, expert) assignments by expert, exchange the per-expert counts
(an all-to-all of counts), send each EP rank the tokens of the experts it owns (all-to-all with
unequal splits) and regroup what arrives by local expert. combine: the reverse, then weight each
expert output by its router probability and sum the k outputs of every token. Experts are owned
in contiguous blocks: EP rank r holds experts r·E/ep ... (r+1)·E/ep - 1.

Every data-dependent size comes from the counts, read on the host once per dispatch
(`host.read`); the ops themselves have static shapes given those sizes, so a dry run (fake
tensors, no counts to read) runs the same code on balanced routing's counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_lite.moe.router import balanced_counts
from megatron_lite.parallel import host, mappings


@dataclass
class DispatchHandle:
    """What combine needs to undo dispatch."""

    num_tokens: int
    token_ids: torch.Tensor  # [N] source token of each sent row (expert-sorted)
    weights: torch.Tensor  # [N] router probability of each sent row
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    regroup: torch.Tensor | None  # [N_recv] (source, expert) order -> (expert, source) order
    during_result: object = None  # what dispatch's `during()` returned


class AllToAllTokenDispatcher:
    """Moves tokens to the EP ranks that own their experts and back. `ep_group` None or of
    size 1 means all experts are local (no communication)."""

    def __init__(self, num_experts: int, ep_group):
        self.ep_group = ep_group
        self.ep = mappings.size(ep_group)
        self.ep_rank = torch.distributed.get_rank(ep_group) if self.ep > 1 else 0
        self.num_experts, self.num_local = num_experts, num_experts // self.ep

    def dispatch(
        self,
        tokens: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None,
        nominal_limit: int | None = None,
        during: Callable[[], object] | None = None,
    ):
        """tokens [T, h], indices/weights [T, k], keep [T, k] bool or None (dropless) ->
        (expert_tokens [N_recv, h] grouped by local expert, tokens_per_local_expert, handle).
        `during()` (e.g. the shared expert) runs while the tokens' all-to-all is in flight;
        its result is `handle.during_result`.
        A real run counts the assignments per expert; a dry run assumes balanced routing on
        every EP rank: T·k/E each, at most `nominal_limit` kept."""
        T, k = indices.shape
        E = self.num_experts
        expert_ids = indices.reshape(-1)  # [T·k]
        if keep is not None:  # dropped assignments get id E: they sort last and are cut off
            expert_ids = torch.where(keep.reshape(-1), expert_ids, E)
        ones = torch.ones_like(expert_ids)
        counts = expert_ids.new_zeros(E + 1).scatter_add_(0, expert_ids, ones)[:E]  # [E] kept
        nominal = functools.partial(self._nominal, T * k, nominal_limit)  # a dry run's
        L, ep = self.num_local, self.ep
        if ep == 1:
            sizes = [counts, counts.sum().reshape(1)]
        else:
            # [E] by destination -> [ep·E_local] by (source rank, local expert)
            recv_counts = mappings.all_to_all(counts, 0, 0, self.ep_group)
            arriving = recv_counts.view(ep, L)
            # rows to each EP rank, from each, per local expert; all kept rows
            sizes = [counts.view(ep, L).sum(1), arriving.sum(1), arriving.sum(0)]
            sizes.append(counts.sum().reshape(1))
        both = host.read(torch.cat(sizes), nominal)  # the one host sync
        n = T * k if keep is None else both[-1]
        order = torch.argsort(expert_ids, stable=True)[:n]  # kept, token order within expert
        token_ids, flat_w = order // k, weights.reshape(-1)[order]  # [N]
        permuted = tokens.index_select(0, token_ids)  # [N, h] sorted by expert
        if ep == 1:
            handle = DispatchHandle(T, token_ids, flat_w, [], [], None)
            handle.during_result = during() if during is not None else None
            return permuted, both[:E], handle
        send, recv, per_local = both[:ep], both[ep : 2 * ep], both[2 * ep : 2 * ep + L]
        result = None
        if during is None:
            received = mappings.all_to_all_uneven(permuted, recv, send, self.ep_group)
        else:  # [N_recv, h], with during() run while the rows are in flight
            received, result = mappings.all_to_all_uneven_overlap(
                permuted, recv, send, self.ep_group, during
            )
        # rows arrive as (source, local expert) blocks; experts want (local expert, source)
        block = torch.arange(ep * L, device=tokens.device)
        block_of_row = block.repeat_interleave(recv_counts, output_size=sum(recv))  # [N_recv]
        source, local = block_of_row // L, block_of_row % L
        regroup = torch.argsort(local * ep + source, stable=True)
        handle = DispatchHandle(T, token_ids, flat_w, send, recv, regroup)
        handle.during_result = result
        return received.index_select(0, regroup), per_local, handle

    def _nominal(self, assignments: int, limit: int | None) -> list[int]:
        """A dry run's host read in dispatch, every EP rank routing alike under balanced routing
        (this rank's [E] kept assignments per expert, at most `limit` each): ep = 1: the [E]
        counts and their sum; ep > 1: the rows sent to each EP rank [ep], received from each
        [ep], per local expert [E_local], and the sum."""
        mine = balanced_counts(assignments, self.num_experts, limit)
        L = self.num_local
        if self.ep == 1:
            return [*mine, sum(mine)]
        local = mine[self.ep_rank * L :][:L]
        send = [sum(mine[r * L : (r + 1) * L]) for r in range(self.ep)]
        return send + [sum(local)] * self.ep + [c * self.ep for c in local] + [sum(mine)]

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_out [N_recv, h] (dispatch's order) -> [T, h]: Σ over kept assignments of
        weight · expert output; dropped assignments contribute zero."""
        if handle.regroup is not None:
            inverse = torch.argsort(handle.regroup)
            back = expert_out.index_select(0, inverse)  # (source, local expert) order
            expert_out = mappings.all_to_all_uneven(
                back, handle.send_splits, handle.recv_splits, self.ep_group
            )  # [N, h] expert-sorted
        y = expert_out * handle.weights.unsqueeze(-1).to(expert_out.dtype)  # [N, h]
        out = expert_out.new_zeros(handle.num_tokens, expert_out.shape[-1])
        return out.index_add(0, handle.token_ids, y)  # [T, h]
