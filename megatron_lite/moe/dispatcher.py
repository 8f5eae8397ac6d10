"""All-to-all token dispatcher over the expert-parallel group.

dispatch: permute the kept (token, expert) assignments by expert, exchange the per-expert counts
(an all-to-all of counts), send each EP rank the tokens of the experts it owns (all-to-all with
unequal splits) and regroup what arrives by local expert. combine: the reverse, then weight each
expert output by its router probability and sum the k outputs of every token. Experts are owned
in contiguous blocks: EP rank r holds experts r·E/ep ... (r+1)·E/ep - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.parallel import mappings


@dataclass
class DispatchHandle:
    """What combine needs to undo dispatch."""

    num_tokens: int
    token_ids: torch.Tensor  # [N] source token of each sent row (expert-sorted)
    weights: torch.Tensor  # [N] router probability of each sent row
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    regroup: torch.Tensor | None  # [N_recv] (source, expert) order -> (expert, source) order


class AllToAllTokenDispatcher:
    """Moves tokens to the EP ranks that own their experts and back. `ep_group` None or of
    size 1 means all experts are local (no communication)."""

    def __init__(self, num_experts: int, ep_group):
        self.ep_group = ep_group
        self.ep = mappings.size(ep_group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep

    def dispatch(
        self,
        tokens: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None,
    ):
        """tokens [T, h], indices/weights [T, k], keep [T, k] bool or None (dropless) ->
        (expert_tokens [N_recv, h] grouped by local expert, tokens_per_local_expert, handle)."""
        T, k = indices.shape
        expert_ids = indices.reshape(-1)  # [T·k]
        token_ids = torch.arange(T, device=tokens.device).repeat_interleave(k)  # [T·k]
        flat_w = weights.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            expert_ids, token_ids, flat_w = expert_ids[kept], token_ids[kept], flat_w[kept]
        order = torch.argsort(expert_ids, stable=True)  # token order within each expert
        token_ids, flat_w = token_ids[order], flat_w[order]
        permuted = tokens.index_select(0, token_ids)  # [N, h] sorted by expert
        counts = torch.bincount(expert_ids, minlength=self.num_experts)  # [E]
        if self.ep == 1:
            handle = DispatchHandle(T, token_ids, flat_w, [], [], None)
            return permuted, counts.tolist(), handle
        # [E] by destination -> [ep·E_local] by (source rank, local expert)
        recv_counts = mappings.all_to_all(counts, 0, 0, self.ep_group)
        send = counts.view(self.ep, self.num_local).sum(1).tolist()
        recv_table = recv_counts.view(self.ep, self.num_local)  # [ep, E_local]
        recv = recv_table.sum(1).tolist()
        received = mappings.all_to_all_uneven(permuted, recv, send, self.ep_group)  # [N_recv, h]
        # rows arrive as (source, local expert) blocks; experts want (local expert, source)
        block = torch.arange(self.ep * self.num_local, device=tokens.device)
        block_of_row = block.repeat_interleave(recv_table.reshape(-1))  # [N_recv]
        source, local = block_of_row // self.num_local, block_of_row % self.num_local
        regroup = torch.argsort(local * self.ep + source, stable=True)
        handle = DispatchHandle(T, token_ids, flat_w, send, recv, regroup)
        return received.index_select(0, regroup), recv_table.sum(0).tolist(), handle

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
