"""The MoE layer (router -> dispatcher -> local experts -> combine) and its per-step metrics.

Aux-loss scaling: the trained objective is
    Σ token CE / N_global + coeff · mean over (microbatches of the global batch, MoE layers) of
    aux_mb (+ z_coeff · the same mean of z_mb),
so each microbatch's aux term gets gradient 1 / (num_microbatches · dp · num_moe_layers) — a
constant of the config, the same on every layout. Gradients of the router are then summed over
dp×cp (and over TP under sequence parallelism) by the gradient finalizer like any other.

Aux-loss-free balancing: the routers' expert biases are not trained by any optimizer;
`moe_metrics` moves them after each optimizer step from the global token counts it has just
all-reduced (the same integers on every rank, so the bias stays replicated exactly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.moe.dispatcher import AllToAllTokenDispatcher
from megatron_lite.moe.experts import LocalExperts
from megatron_lite.moe.router import MoEAuxLossAutoScaler, RouterOptions, TopKRouter
from megatron_lite.parallel import host, mappings
from megatron_lite.parallel.params import fsdp_rows, set_meta
from megatron_lite.parallel.recompute import is_recomputing


class MoELayer(nn.Module):
    """Drop-in replacement of the MLP: [s/cp(/tp), b, h] -> same shape.

    Each rank routes its own tokens (its sequence shard under CP/SP); experts are spread over
    `ep_group` (this rank holds experts ep_rank·E/ep ... (ep_rank+1)·E/ep - 1), the router is
    replicated. `token_groups` are the groups holding the other sequence shards of the same
    microbatch, innermost first ([tp_group, cp_group] under sequence parallelism, else
    [cp_group]): the router's aux loss, z-loss and capacity are computed over the whole
    microbatch. `aux_loss_scale` is the gradient each microbatch's aux term gets (module doc).
    `layer_number` keys this layer's statistics in `moe_metrics`: unique across the model.
    Per forward it appends microbatch-global statistics (tokens per expert, aux loss, z-loss,
    dropped assignments) that `moe_metrics` collects.

    `shared_expert_gate` (with a shared expert; Qwen2-MoE, Megatron's moe_shared_expert_gate):
    the shared expert's output is scaled per token by sigmoid(x·gᵀ), g [1, h] a replicated
    weight like the router's (its gradient summed over TP under sequence parallelism).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        topk: int,
        *,
        ep_group=None,
        token_groups: list | None = None,
        sequence_parallel: bool = False,
        gated: bool = True,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        aux_loss_scale: float = 1.0,
        capacity_factor: float | None = None,
        init_std: float = 0.02,
        output_std: float = 0.02,
        layer_number: int = 0,
        router_options: RouterOptions | None = None,
        grouped_gemm: bool = True,
        shared_expert: nn.Module | None = None,
        shared_expert_overlap: bool = False,
        shared_expert_gate: bool = False,
    ):
        super().__init__()
        ep_size = mappings.size(ep_group)
        ep_rank = torch.distributed.get_rank(ep_group) if ep_size > 1 else 0
        self.num_experts, self.layer_number = num_experts, layer_number
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            topk,
            aux_loss_coeff=aux_loss_coeff,
            z_loss_coeff=z_loss_coeff,
            capacity_factor=capacity_factor,
            token_groups=token_groups,
            sequence_parallel=sequence_parallel,
            init_std=init_std,
            options=router_options or RouterOptions(),
        )
        self.experts = LocalExperts(
            num_experts,
            hidden_size,
            ffn_hidden_size,
            ep_rank=ep_rank,
            ep_size=ep_size,
            gated=gated,
            sequence_parallel=sequence_parallel,
            init_std=init_std,
            output_std=output_std,
            grouped_gemm=grouped_gemm,
        )
        # a dense MLP every token passes through, on the dense MLP's TP/SP layout
        self.shared_expert = shared_expert
        self.shared_expert_overlap = shared_expert_overlap
        self.shared_expert_gate: nn.Parameter | None = None
        if shared_expert_gate:
            if shared_expert is None:
                raise ValueError("MoELayer: shared_expert_gate=True needs a shared_expert")
            self.shared_expert_gate = set_meta(
                nn.Parameter(torch.empty(1, hidden_size)),
                full_shape=(1, hidden_size),
                std=init_std,
                sequence_parallel=sequence_parallel,
            )
        self.dispatcher = AllToAllTokenDispatcher(num_experts, ep_group)
        self.aux_scale = aux_loss_scale
        # per forward since the last pop: float64 [E + 3] and what a dry run assumes it holds
        self.stats: list[tuple[torch.Tensor, Callable[[], list[float]]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)  # [T, h], T = s/cp(/tp)·b in (s, b) order
        route = self.router(tokens, b)
        overlap = self.shared_expert is not None and self.shared_expert_overlap
        expert_in, counts, handle = self.dispatcher.dispatch(
            tokens,
            route.indices,
            route.weights,
            route.keep,
            route.nominal_limit,
            during=(lambda: self.shared(x)) if overlap else None,
        )
        expert_out = self.experts(expert_in, counts).to(x.dtype)  # [N_recv, h]
        out = self.dispatcher.combine(expert_out, handle).view(s, b, h)
        if self.shared_expert is not None:  # [s(/tp), b, h], beside the all-to-all if overlapped
            out = out + (handle.during_result if overlap else self.shared(x))
        if route.objective is not None and out.requires_grad:
            out = MoEAuxLossAutoScaler.apply(out, route.objective, self.aux_scale)
        if not is_recomputing():  # a backward-time recompute must not count the tokens again
            self.stats.append((route.stats, route.nominal_stats))
        return out

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output [s(/tp), b, h], times its gate sigmoid(x·gᵀ) [s(/tp), b, 1]
        when it has one."""
        out = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            out = out * torch.sigmoid(F.linear(x, self.shared_expert_gate.to(x.dtype)))
        return out

    def pop_stats(self) -> list[tuple[torch.Tensor, Callable[[], list[float]]]]:
        stats, self.stats = self.stats, []
        return stats


def moe_layers(modules: list[nn.Module]) -> list[MoELayer]:
    """Every MoELayer inside `modules` (found by walking them, whatever the model)."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]


def moe_metrics(
    modules: list[nn.Module],
    num_layers: int,
    num_experts: int,
    count_here: bool,
    with_z_loss: bool = False,
    group=None,
    *,
    expert_bias: bool = False,
    update_bias: bool = False,
    per_layer: bool = True,
) -> dict:
    """Step metrics of every MoE layer, reduced over `group` (default: the world) with one
    all-reduce, and the expert-bias update. Call on every rank of the group once per step,
    after the forward/backward passes and the optimizer step.

    `num_layers` bounds the layer numbers (`MoELayer.layer_number`) over the whole model (a rank
    may hold no MoE layer: a pipeline stage of dense layers);
    `count_here` is true on the one rank per microbatch shard group whose statistics count
    (they are microbatch-global, identical on its TP and CP ranks: tp rank 0 and cp rank 0).
    Returns aux_loss (the unscaled load-balancing loss of the configured type, 1.0 = uniform,
    mean over the microbatches of the global batch and the MoE layers), z_loss (same mean, with
    `with_z_loss`), tokens_per_expert_min/_max (token assignments per expert summed over the
    global batch, before capacity dropping; min/max over every (layer, expert)),
    dropped_tokens (assignments dropped over capacity, summed over the global batch and
    layers) and load_max_mean_ratio (max over the layers of max/mean tokens per expert).
    `expert_bias` (the layers route with one; the same on every rank): also
    expert_bias_min/_max over every (layer, expert), the bias this step routed with.
    `per_layer`: also moe/layer_<i>/load_max_mean_ratio, /dropped_tokens (and
    /expert_bias_min, /expert_bias_max) for each MoE layer i of the model.
    `update_bias` (the optimizer stepped; with `expert_bias`): every layer here moves its bias
    by the layer's global token counts (TopKRouter.update_expert_bias), identically on every
    rank and layout, since the counts are exact integers.
    """
    layers = moe_layers(modules)
    E, L = num_experts, num_layers
    B = L * E if expert_bias else 0
    device = next(modules[0].parameters()).device  # NCCL reduces device tensors only
    # [L·E] tokens per (layer, expert) | aux sum, z sum, (microbatch, layer) entries, dropped |
    # [L] 1 where a rank holds that MoE layer (so dense layers stay out of the min/max) |
    # [L] dropped per layer | expert_bias: [L·E] bias sums, [L·E] ranks holding each element
    vec = torch.zeros(L * E + 4 + 2 * L + 2 * B, dtype=torch.float64, device=device)
    totals, held = vec[L * E : L * E + 4], vec[L * E + 4 : L * E + 4 + L]
    dropped_at = vec[L * E + 4 + L : L * E + 4 + 2 * L]
    bias_sum = vec[L * E + 4 + 2 * L : L * E + 4 + 2 * L + B].view(-1, E)
    bias_holders = vec[L * E + 4 + 2 * L + B :].view(-1, E)
    forwards = []  # (layer number, a dry run's stats) of each forward here
    for layer in layers:
        i = layer.layer_number
        held[i] = 1.0
        if expert_bias:  # the local rows (ZeRO-3 holds a shard): summed with their holders
            lo, hi, values = _local_bias(layer.router.expert_bias)
            bias_sum[i, lo:hi] += values
            bias_holders[i, lo:hi] += 1.0
        for st, nominal in layer.pop_stats():
            forwards.append((i, nominal))
            if count_here:
                vec[i * E : (i + 1) * E] += st[:E]
                totals += torch.stack([st[E], st[E + 1], st.new_ones(()), st[E + 2]])
                dropped_at[i] += st[E + 2]
    mappings.all_reduce(vec, group or dist.group.WORLD, kind="all_reduce_report")
    if update_bias and expert_bias:
        for layer in layers:
            i = layer.layer_number
            layer.router.update_expert_bias(vec[i * E : (i + 1) * E])
    here = [layer.layer_number for layer in layers]
    values = host.read(vec, lambda: _own_share(L, E, B, here, forwards))
    return _summary(values, L, E, B, with_z_loss, per_layer)


def _local_bias(bias: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(start, end, values) of the expert-bias elements this rank holds (a ZeRO-3 shard's
    rows, or all of them), as float64."""
    rows = fsdp_rows(bias)
    if rows is None:
        return 0, bias.shape[0], bias.detach().double()
    return rows[0], rows[1], bias.to_local().detach().double()


def _summary(values: list[float], L: int, E: int, B: int, with_z: bool, per_layer: bool):
    """moe_metrics' record from the reduced vector (see the layout there)."""
    held = values[L * E + 4 : L * E + 4 + L]
    moe = [i for i in range(L) if held[i] > 0]
    counts = {i: values[i * E : (i + 1) * E] for i in moe}
    aux, z, entries, dropped = values[L * E : L * E + 4]
    ratio = {i: max(c) / max(sum(c) / E, 1e-30) for i, c in counts.items()}
    out = {
        "aux_loss": aux / max(entries, 1.0),
        "tokens_per_expert_min": int(min((min(c) for c in counts.values()), default=0.0)),
        "tokens_per_expert_max": int(max((max(c) for c in counts.values()), default=0.0)),
        "dropped_tokens": int(dropped),
        "load_max_mean_ratio": max(ratio.values(), default=0.0),
    }
    if with_z:
        out["z_loss"] = z / max(entries, 1.0)
    bias = {}
    if B:
        sums, holders = values[L * E + 4 + 2 * L :][:B], values[L * E + 4 + 2 * L + B :]
        for i in moe:  # every element of a layer is held somewhere: exact means of copies
            row = slice(i * E, (i + 1) * E)
            bias[i] = [s / h for s, h in zip(sums[row], holders[row], strict=True)]
        out["expert_bias_min"] = min((min(b) for b in bias.values()), default=0.0)
        out["expert_bias_max"] = max((max(b) for b in bias.values()), default=0.0)
    if per_layer:
        dropped_at = values[L * E + 4 + L : L * E + 4 + 2 * L]
        for i in moe:
            out[f"moe/layer_{i}/load_max_mean_ratio"] = ratio[i]
            out[f"moe/layer_{i}/dropped_tokens"] = int(dropped_at[i])
            if B:
                out[f"moe/layer_{i}/expert_bias_min"] = min(bias[i])
                out[f"moe/layer_{i}/expert_bias_max"] = max(bias[i])
    return out


def _own_share(L: int, E: int, B: int, held: list[int], forwards: list) -> list[float]:
    """A dry run's `vec` in moe_metrics (no other rank to sum): this rank's layers and the
    nominal stats of its own forwards, whether or not it is the rank that counts them; a zero
    expert bias (its value at the start, which a dry run cannot read)."""
    vec = [0.0] * (L * E + 4 + 2 * L + 2 * B)
    for i in held:
        vec[L * E + 4 + i] = 1.0
        for e in range(E if B else 0):
            vec[L * E + 4 + 2 * L + B + i * E + e] = 1.0
    for i, nominal in forwards:
        st = nominal()  # [E + 3]
        for e in range(E):
            vec[i * E + e] += st[e]
        for j, v in enumerate([st[E], st[E + 1], 1.0, st[E + 2]]):
            vec[L * E + j] += v
        vec[L * E + 4 + L + i] += st[E + 2]
    return vec
