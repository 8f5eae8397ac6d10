"""Top-k router (softmax or sigmoid scores): expert choice, aux-loss-free balancing by an
expert bias, group-limited routing, load-balancing aux loss (global or per sequence), z-loss
and capacity dropping.

DeepSeek-V3 conventions (arXiv 2412.19437, eqs. 12-20; Megatron-Core agrees): selection ranks
scores + expert_bias (the bias only picks, it never weights); the combine weights are the
selected unbiased scores (normalized over the top-k for sigmoid, times the scaling factor);
with groups, each token keeps the group_topk groups whose group scores are highest, then takes
its top-k inside them. A group's score is the sum of its top (topk // group_topk) selection
scores (`group_score="topk_per_group"`, Megatron-Core's group_limited_topk) or of its top 2
(`"top2"`, DeepSeek-V3's released code and HF's DeepseekV3TopkRouter); the two agree when
topk = 2·group_topk, as in DeepSeek-V3 itself (8 of 4 groups). The aux losses read P from the scores
normalized per token (softmax: the probabilities; sigmoid: s / Σ_j s_j) and f from the top-k
of those unbiased scores over all experts (eq. 18's indicator), so neither the bias nor the
group limit changes them.

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

from megatron_lite.moe.group_score import GROUP_SCORES, group_score_width
from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.params import fsdp_rows, set_meta


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
    group_score: str = "topk_per_group"  # topk_per_group (Megatron) | top2 (DeepSeek-V3)


# ---------------------------------------------------------------- pure functions (unit-tested)
def topk_softmax(logits: torch.Tensor, topk: int):
    """Softmax over all experts, then top-k (Megatron's default; no renormalization).

    logits [T, E] -> probs [T, E], weights [T, k] (the top-k probabilities), indices [T, k].
    """
    probs = torch.softmax(logits, dim=-1)
    weights, indices = torch.topk(probs, topk, dim=-1)
    return probs, weights, indices


def router_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """logits [T, E] -> scores [T, E]: softmax over the experts, or sigmoid of each (DeepSeek-V3
    eq. 15: token-to-expert affinities in (0, 1), independent across experts)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(
        f"model.moe_router_score_function={score_function!r}: must be softmax or sigmoid"
    )


def aux_loss_scores(scores: torch.Tensor, score_function: str) -> torch.Tensor:
    """The P of the aux losses: scores [T, E] normalized per token (softmax scores already
    are; sigmoid scores are divided by their sum, DeepSeek-V3 eq. 19)."""
    if score_function == "sigmoid":
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)
    return scores


def group_limited_mask(
    select: torch.Tensor,
    num_groups: int,
    group_topk: int,
    topk: int,
    group_score: str = "topk_per_group",
) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3 node-limited routing): the experts are num_groups
    contiguous groups; a group's score for a token is the sum of its top n selection scores
    (n = `group_score_width`: topk // group_topk, or 2 for DeepSeek-V3's rule); each token
    keeps its group_topk best groups.

    select [T, E] -> mask [T, E] bool, True where the token may pick the expert."""
    T, E = select.shape
    per_group = E // num_groups
    n = group_score_width(group_score, topk, group_topk)
    group_scores = select.view(T, num_groups, per_group).topk(n, dim=-1)  # [T, G, n]
    best = group_scores.values.sum(-1).topk(group_topk, dim=-1).indices  # [T, group_topk]
    keep = torch.zeros(T, num_groups, dtype=torch.bool, device=select.device)
    keep.scatter_(1, best, True)
    return keep.repeat_interleave(per_group, dim=1)  # [T, G] -> [T, E]


def select_experts(
    scores: torch.Tensor,
    topk: int,
    expert_bias: torch.Tensor | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score: str = "topk_per_group",
) -> torch.Tensor:
    """The top-k experts of each token: scores [T, E] (+ expert_bias [E], selection only),
    limited to its best groups (scored by `group_score`) when num_groups is set -> indices
    [T, k]."""
    select = scores.detach()
    if expert_bias is not None:
        select = select + expert_bias.to(select.dtype)
    if num_groups is not None:
        allowed = group_limited_mask(select, num_groups, group_topk, topk, group_score)
        select = select.masked_fill(~allowed, float("-inf"))
    return torch.topk(select, topk, dim=-1).indices


def expert_bias_delta(counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing's update (DeepSeek-V3 sec. 2.1.2): rate · sign(mean load −
    load_i), from the token counts [E] of one layer over the global batch -> [E] float64."""
    counts = counts.double()
    return rate * torch.sign(counts.mean() - counts)


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


def sequence_load_balancing_loss(
    prob_sum: torch.Tensor, counts: torch.Tensor, tokens_per_sequence: float, topk: int
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (eqs. 17-20, without its α):
    per sequence f_i = E/(k·T_s) · counts_i and P_i = prob_sum_i / T_s, loss Σ_i f_i·P_i,
    averaged over the sequences (Megatron's seq_aux_loss; 1 for uniform routing, as the
    global loss). prob_sum, counts: [b, E] per sequence; T_s tokens per sequence."""
    b, num_experts = counts.shape
    scale = num_experts / (tokens_per_sequence * tokens_per_sequence * topk * b)
    return scale * (prob_sum * counts).sum()


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

    weights: torch.Tensor  # [T, k] combine weights: the scaled top-k scores (differentiable)
    indices: torch.Tensor  # [T, k] expert ids
    keep: torch.Tensor | None  # [T, k] bool, False = dropped over capacity; None = dropless
    objective: torch.Tensor | None  # local term whose grads, summed over shards, are d(aux)
    stats: torch.Tensor  # float64 [E + 3]: tokens per expert, aux loss, z-loss, dropped
    # what a dry run assumes (balanced routing; see TopKRouter.nominal_stats)
    nominal_limit: int | None  # kept assignments per expert of the T local tokens (None: all)
    nominal_stats: Callable[[], list[float]]  # [E + 3] the values of `stats`


def _check_options(opt: RouterOptions, num_experts: int, topk: int) -> None:
    """The router's own checks, for users who build it without our config validation."""
    if opt.score_function not in ("softmax", "sigmoid"):
        raise ValueError(
            f"RouterOptions.score_function={opt.score_function!r}: use softmax or sigmoid"
        )
    if opt.aux_loss_type not in ("global", "seq"):
        raise ValueError(f"RouterOptions.aux_loss_type={opt.aux_loss_type!r}: use global or seq")
    if opt.group_score not in GROUP_SCORES:
        raise ValueError(
            f"RouterOptions.group_score={opt.group_score!r}: use {' or '.join(GROUP_SCORES)}"
        )
    if (opt.num_groups is None) != (opt.group_topk is None):
        raise ValueError(
            f"RouterOptions num_groups={opt.num_groups}, group_topk={opt.group_topk}: "
            "group-limited routing needs both (or neither)"
        )
    if opt.num_groups is not None:
        G, M = opt.num_groups, opt.group_topk
        if num_experts % G or not 1 <= M <= G or not M <= topk <= M * (num_experts // G):
            raise ValueError(
                f"RouterOptions num_groups={G}, group_topk={M} with {num_experts} experts, "
                f"top-{topk}: groups must divide the experts and group_topk <= topk <= "
                "group_topk · experts per group"
            )
        if group_score_width(opt.group_score, topk, M) > num_experts // G:
            raise ValueError(
                f"RouterOptions group_score={opt.group_score!r} sums a group's top "
                f"{group_score_width(opt.group_score, topk, M)} scores, but a group holds "
                f"{num_experts // G} experts: use groups of at least that many experts"
            )


class TopKRouter(nn.Module):
    """Linear router h -> E computed in fp32: scores (softmax or sigmoid), top-k selection
    (with the expert bias and group limit of `options`), aux/z losses and capacity.

    forward(x [T, h], batch_size b) -> Routing, the T = s_local·b tokens in (s, b) order.
    `token_groups` lists the groups holding the other sequence shards of the same microbatch
    (innermost first); the weight is replicated, and with `sequence_parallel` its gradient is
    summed over TP by the gradient finalizer. With options.enable_expert_bias, `expert_bias`
    [E] fp32 is a parameter that no optimizer trains (requires_grad False, so the data-parallel
    wrappers leave it out) and the checkpoint stores; `update_expert_bias` moves it after
    each optimizer step from the global token counts (moe_metrics).
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
        _check_options(self.options, num_experts, topk)
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
        self.expert_bias: nn.Parameter | None = None
        if self.options.enable_expert_bias:
            self.expert_bias = set_meta(
                nn.Parameter(torch.zeros(num_experts), requires_grad=False),
                full_shape=(num_experts,),
                init="zeros",
            )

    def forward(self, x: torch.Tensor, batch_size: int = 1) -> Routing:
        E, k, opt = self.num_experts, self.topk, self.options
        dtype = torch.promote_types(x.dtype, torch.float32)  # route in fp32 (or finer)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))  # [T, E]
        scores = router_scores(logits, opt.score_function)  # [T, E]
        indices = select_experts(
            scores, k, self.expert_bias, opt.num_groups, opt.group_topk, opt.group_score
        )
        weights = scale_topk(scores.gather(1, indices), opt, k)  # [T, k] unbiased scores
        probs = aux_loss_scores(scores, opt.score_function)  # [T, E] the aux losses' P
        lse_sq = torch.logsumexp(logits, dim=-1).square()  # [T] for the z-loss
        assign = torch.zeros_like(probs).scatter_(1, indices, 1.0)  # [T, E] 0/1
        aux_assign = assign  # eq. 18's top-k: of the unbiased scores over all experts
        if self.expert_bias is not None or opt.num_groups is not None:
            aux_idx = torch.topk(probs.detach(), k, dim=-1).indices
            aux_assign = torch.zeros_like(probs).scatter_(1, aux_idx, 1.0)
        seq = opt.aux_loss_type == "seq"
        n_local = torch.full((1,), float(x.shape[0]), dtype=dtype, device=x.device)
        parts = [assign.sum(0), aux_assign.sum(0), probs.detach().sum(0)]
        parts += [lse_sq.detach().sum().reshape(1), n_local]
        if seq:  # per-sequence [b, E] counts and P sums: token t is of sequence t mod b
            parts += [aux_assign.view(-1, batch_size, E).sum(0).reshape(-1)]
            parts += [probs.detach().view(-1, batch_size, E).sum(0).reshape(-1)]
        local = torch.cat(parts).double()  # [3E + 2 (+ 2bE)]
        total, before = gather_token_shards(local, self.token_groups)
        counts, aux_counts, prob_sum = total[:E], total[E : 2 * E], total[2 * E : 3 * E]
        z_sum, n_tokens = total[3 * E], total[3 * E + 1]
        shards = math.prod(mappings.size(g) for g in self.token_groups)
        n = host.read(n_tokens, float(x.shape[0] * shards))  # a dry run: even sequence shards
        if seq:
            seq_counts = total[3 * E + 2 : 3 * E + 2 + batch_size * E].view(batch_size, E)
            seq_probs = total[3 * E + 2 + batch_size * E :].view(batch_size, E)
            aux = sequence_load_balancing_loss(seq_probs, seq_counts, n / batch_size, k)
        else:
            aux = load_balancing_loss(prob_sum, aux_counts, n, k)
        keep, dropped = None, torch.zeros((), dtype=torch.float64, device=x.device)
        cap = None
        if self.capacity_factor is not None:
            cap = expert_capacity(round(n), E, k, self.capacity_factor)
            keep = capacity_keep(assign, indices, before[:E].to(assign.dtype), cap)
            dropped = (counts - cap).clamp(min=0).sum()  # global: first `cap` in order kept
        objective = None
        if self.aux_loss_coeff:  # f is a constant; P's gradient flows through local tokens
            if seq:
                local_p = probs.view(-1, batch_size, E).sum(0)  # [b, E] this shard's P sums
                f = seq_counts.to(probs.dtype)
                aux_term = sequence_load_balancing_loss(local_p, f, n / batch_size, k)
            else:
                aux_term = load_balancing_loss(probs.sum(0), aux_counts.to(probs.dtype), n, k)
            objective = self.aux_loss_coeff * aux_term
        if self.z_loss_coeff:
            z_term = self.z_loss_coeff * lse_sq.sum() / n
            objective = z_term if objective is None else objective + z_term
        stats = torch.cat([counts, aux.reshape(1), (z_sum / n).reshape(1), dropped.reshape(1)])
        share = None if cap is None else cap * x.shape[0] // round(n)  # this shard's
        nominal = functools.partial(self.nominal_stats, round(n), cap)
        return Routing(weights, indices, keep, objective, stats, share, nominal)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """expert_bias += rate · sign(mean − counts) (counts [E]: this layer's token
        assignments over the global batch, identical on every rank). A ZeRO-3 (FSDP2) shard
        updates its own rows."""
        bias = self.expert_bias
        if bias is None:
            raise RuntimeError(
                "update_expert_bias: this router has no expert bias. Fix: build it with "
                "RouterOptions(enable_expert_bias=True) (model.moe_router_enable_expert_bias)"
            )
        delta = expert_bias_delta(counts, self.options.bias_update_rate).to(bias.dtype)
        rows = fsdp_rows(bias)
        if rows is None:
            bias.add_(delta)
        else:
            bias.to_local().add_(delta[rows[0] : rows[1]])

    def step_updated_state(self) -> list[tuple[str, torch.Tensor, str]]:
        """State the step changes outside the optimizer, for the non-finite guard
        (training/nonfinite.py): the expert bias, with the key that drives its update."""
        if self.expert_bias is None:
            return []
        return [("expert_bias", self.expert_bias, "model.moe_router_bias_update_rate")]

    def nominal_stats(self, num_tokens: int, capacity: int | None) -> list[float]:
        """`stats` of a microbatch of `num_tokens` under a dry run's routing: balanced counts,
        and uniform probabilities (aux loss 1, global or per sequence; zero logits, so every
        logsumexp is log E)."""
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
