"""Top-k softmax router: expert choice, load-balancing aux loss, z-loss and capacity dropping.

Routing is per token, but the aux loss, the z-loss and the capacity are defined over ALL tokens
of a microbatch. Under context or sequence parallelism a rank holds a contiguous sequence shard
of the microbatch, so the router all-gathers tiny per-shard statistics over the groups that hold
the other shards (`token_groups`, innermost first: TP if sequence parallel, then CP). That keeps
every number, and every dropping decision, identical to a single-rank run.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.params import set_meta


@dataclass(frozen=True)
class RouterOptions:
    """How the router scores and picks experts (the model.moe_router_* keys; defaults = the
    Mixtral-style softmax top-k router)."""

    score_function: str = "softmax"  # softmax | sigmoid
    topk_scaling_factor: float | None = None  # the top-k weights × this (None = 1)
    norm_topk: bool | None = None  # renormalize the top-k weights (None: sigmoid with k > 1)
    enable_expert_bias: bool = False  # aux-loss-free balancing: a bias for selection only
    bias_update_rate: float = 1e-3  # bias += rate · sign(mean load - load) after each step
    aux_loss_type: str = "global"  # global (over the microbatch) | seq (per sequence)
    num_groups: int | None = None  # group-limited routing: experts in this many groups
    group_topk: int | None = None  # groups each token may route to


# ---------------------------------------------------------------- pure functions (unit-tested)
def topk_softmax(logits: torch.Tensor, topk: int):
    """Softmax over all experts, then top-k (Megatron's default; no renormalization).

    logits [T, E] -> probs [T, E], weights [T, k] (the top-k probabilities), indices [T, k].
    """
    probs = torch.softmax(logits, dim=-1)
    weights, indices = torch.topk(probs, topk, dim=-1)
    return probs, weights, indices


def scale_topk(weights: torch.Tensor, options: RouterOptions, topk: int) -> torch.Tensor:
    """The combine weights from the top-k scores [T, k]: renormalized to sum to 1 when
    `options.norm_topk` (None: for sigmoid scores with k > 1, as DeepSeek-V3), then times
    `options.topk_scaling_factor` (DeepSeek-V3: 2.5)."""
    norm = options.norm_topk
    if norm is None:
        norm = options.score_function == "sigmoid" and topk > 1
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    if options.topk_scaling_factor is not None:
        weights = weights * options.topk_scaling_factor
    return weights


def load_balancing_loss(
    prob_sum: torch.Tensor, counts: torch.Tensor, num_tokens: float, topk: int
) -> torch.Tensor:
    """Switch/Megatron aux loss E · Σ_i f_i · P_i with f_i = counts_i / (T·k) (fraction of the
    token-assignments that chose expert i) and P_i = prob_sum_i / T (mean router probability).
    Equals 1 for perfectly uniform routing. prob_sum, counts: [E]."""
    num_experts = counts.shape[0]
    return num_experts / (num_tokens * num_tokens * topk) * (prob_sum * counts).sum()


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Assignments an expert accepts from one microbatch: ceil(factor · T · k / E)."""
    return math.ceil(factor * num_tokens * topk / num_experts)


def balanced_counts(assignments: int, num_experts: int, limit: int | None = None) -> list[int]:
    """Balanced routing, what a dry run assumes: `assignments` spread over the experts as evenly
    as integers allow (the first experts take the remainder), each capped at `limit`."""
    share, extra = divmod(assignments, num_experts)
    counts = [share + (e < extra) for e in range(num_experts)]
    return counts if limit is None else [min(c, limit) for c in counts]


def capacity_keep(
    assign: torch.Tensor, indices: torch.Tensor, offset: torch.Tensor, capacity: int
) -> torch.Tensor:
    """Keep the first `capacity` assignments of each expert in token order (Megatron's
    "position" drop policy); deterministic, independent of the router probabilities.

    assign [T, E] 0/1 (token t chose expert e), indices [T, k], offset [E] assignments made by
    earlier tokens on other shards -> keep [T, k] bool.
    """
    position = torch.cumsum(assign, dim=0) - 1 + offset  # [T, E] rank within its expert
    return position.gather(1, indices) < capacity


def gather_token_shards(
    local: torch.Tensor, token_groups: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather a per-shard statistics vector [n] over the groups that hold the other sequence
    shards of this microbatch (innermost first). Returns (sum over all shards, sum over the
    shards that come before this one in token order)."""
    n = local.numel()
    rows, index = local.reshape(1, n), 0
    for group in token_groups:
        size = mappings.size(group)
        rank = torch.distributed.get_rank(group) if size > 1 else 0
        index += rank * rows.shape[0]
        rows = mappings.all_gather_dim0(rows.reshape(1, -1), group).reshape(-1, n)  # [shards, n]
    return rows.sum(0), rows[:index].sum(0)


# ---------------------------------------------------------------- the router module
@dataclass
class Routing:
    """What the router decided for T local tokens, plus microbatch-global statistics."""

    weights: torch.Tensor  # [T, k] top-k probabilities (differentiable)
    indices: torch.Tensor  # [T, k] expert ids
    keep: torch.Tensor | None  # [T, k] bool, False = dropped over capacity; None = dropless
    objective: torch.Tensor | None  # local term whose grads, summed over shards, are d(aux)
    stats: torch.Tensor  # float64 [E + 3]: tokens per expert, aux loss, z-loss, dropped
    # what a dry run assumes (balanced routing; see TopKRouter.nominal_stats)
    nominal_limit: int | None  # kept assignments per expert of the T local tokens (None: all)
    nominal_stats: Callable[[], list[float]]  # [E + 3] the values of `stats`


class TopKRouter(nn.Module):
    """Linear router h -> E computed in fp32, softmax top-k, aux/z losses and capacity.

    forward(x [T, h]) -> Routing. `token_groups` lists the groups holding the other sequence
    shards of the same microbatch (innermost first); the weight is replicated, and with
    `sequence_parallel` its gradient is summed over TP by the gradient finalizer.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        topk: int,
        *,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        capacity_factor: float | None = None,
        token_groups: list | None = None,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        options: RouterOptions | None = None,
    ):
        super().__init__()
        self.options = options or RouterOptions()
        self.num_experts, self.topk = num_experts, topk
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor = capacity_factor
        self.token_groups = list(token_groups or [])
        self.weight = set_meta(
            nn.Parameter(torch.empty(num_experts, hidden_size)),
            full_shape=(num_experts, hidden_size),
            std=init_std,
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> Routing:
        E, k = self.num_experts, self.topk
        dtype = torch.promote_types(x.dtype, torch.float32)  # route in fp32 (or finer)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))  # [T, E]
        probs, weights, indices = topk_softmax(logits, k)
        weights = scale_topk(weights, self.options, k)
        lse_sq = torch.logsumexp(logits, dim=-1).square()  # [T] for the z-loss
        assign = torch.zeros_like(probs).scatter_(1, indices, 1.0)  # [T, E] 0/1
        n_local = torch.full((1,), float(x.shape[0]), dtype=dtype, device=x.device)
        local = torch.cat(
            [assign.sum(0), probs.detach().sum(0), lse_sq.detach().sum().reshape(1), n_local]
        ).double()  # [2E + 2]
        total, before = gather_token_shards(local, self.token_groups)  # [2E + 2]
        counts, prob_sum, z_sum, n_tokens = total[:E], total[E : 2 * E], total[2 * E], total[-1]
        shards = math.prod(mappings.size(g) for g in self.token_groups)
        n = host.read(n_tokens, float(x.shape[0] * shards))  # a dry run: even sequence shards
        aux = load_balancing_loss(prob_sum, counts, n, k)
        keep, dropped = None, torch.zeros((), dtype=torch.float64, device=x.device)
        cap = None
        if self.capacity_factor is not None:
            cap = expert_capacity(round(n), E, k, self.capacity_factor)
            keep = capacity_keep(assign, indices, before[:E].to(assign.dtype), cap)
            dropped = (counts - cap).clamp(min=0).sum()  # global: first `cap` in order kept
        objective = None
        if self.aux_loss_coeff:  # f is a constant; P's gradient flows through local tokens
            objective = self.aux_loss_coeff * load_balancing_loss(
                probs.sum(0), counts.to(probs.dtype), n, k
            )
        if self.z_loss_coeff:
            z_term = self.z_loss_coeff * lse_sq.sum() / n
            objective = z_term if objective is None else objective + z_term
        stats = torch.cat([counts, aux.reshape(1), (z_sum / n).reshape(1), dropped.reshape(1)])
        share = None if cap is None else cap * x.shape[0] // round(n)  # this shard's
        nominal = functools.partial(self.nominal_stats, round(n), cap)
        return Routing(weights, indices, keep, objective, stats, share, nominal)

    def nominal_stats(self, num_tokens: int, capacity: int | None) -> list[float]:
        """`stats` of a microbatch of `num_tokens` under a dry run's routing: balanced counts,
        and uniform probabilities (aux loss 1; zero logits, so every logsumexp is log E)."""
        E = self.num_experts
        counts = balanced_counts(num_tokens * self.topk, E)
        dropped = 0 if capacity is None else sum(max(c - capacity, 0) for c in counts)
        return [*map(float, counts), 1.0, math.log(E) ** 2, float(dropped)]


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; its backward also sends gradient `scale` into `objective`, so the
    router is trained on  main loss + scale · objective  without changing the returned loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, objective: torch.Tensor, scale: float):
        ctx.save_for_backward(objective)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (objective,) = ctx.saved_tensors
        return grad_output, torch.ones_like(objective) * ctx.scale, None
