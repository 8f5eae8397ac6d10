"""The MoE layer (router -> dispatcher -> local experts -> combine) and its per-step metrics.

Aux-loss scaling: the trained objective is
    Σ token CE / N_global + coeff · mean over (microbatches of the global batch, MoE layers) of
    aux_mb (+ z_coeff · the same mean of z_mb),
so each microbatch's aux term gets gradient 1 / (num_microbatches · dp · num_moe_layers) — a
constant of the config, the same on every layout. Gradients of the router are then summed over
dp×cp (and over TP under sequence parallelism) by the gradient finalizer like any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.moe.dispatcher import AllToAllTokenDispatcher
from megatron_lite.moe.experts import LocalExperts
from megatron_lite.moe.router import MoEAuxLossAutoScaler, RouterOptions, TopKRouter
from megatron_lite.parallel import host, mappings
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
        self.dispatcher = AllToAllTokenDispatcher(num_experts, ep_group)
        self.aux_scale = aux_loss_scale
        # per forward since the last pop: float64 [E + 3] and what a dry run assumes it holds
        self.stats: list[tuple[torch.Tensor, Callable[[], list[float]]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)  # [T, h], T = s/cp(/tp)·b in (s, b) order
        route = self.router(tokens)
        expert_in, counts, handle = self.dispatcher.dispatch(
            tokens, route.indices, route.weights, route.keep, route.nominal_limit
        )
        expert_out = self.experts(expert_in, counts).to(x.dtype)  # [N_recv, h]
        out = self.dispatcher.combine(expert_out, handle).view(s, b, h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if route.objective is not None and out.requires_grad:
            out = MoEAuxLossAutoScaler.apply(out, route.objective, self.aux_scale)
        if not is_recomputing():  # a backward-time recompute must not count the tokens again
            self.stats.append((route.stats, route.nominal_stats))
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
) -> dict:
    """Step metrics of every MoE layer, reduced over `group` (default: the world) with one
    all-reduce. Call on every rank of the group once per step, after the forward/backward passes.

    `num_layers` bounds the layer numbers (`MoELayer.layer_number`) over the whole model (a rank
    may hold no MoE layer: a pipeline stage of dense layers);
    `count_here` is true on the one rank per microbatch shard group whose statistics count
    (they are microbatch-global, identical on its TP and CP ranks: tp rank 0 and cp rank 0).
    Returns aux_loss (the unscaled load-balancing loss, 1.0 = uniform, mean over the microbatches
    of the global batch and the MoE layers), z_loss (same mean, only when a layer has a z-loss
    coefficient), tokens_per_expert_min/_max (token assignments per expert summed over the global
    batch, before capacity dropping; min/max over every (layer, expert)) and dropped_tokens
    (assignments dropped over capacity, summed over the global batch and layers); z_loss too
    with `with_z_loss`.
    """
    layers = moe_layers(modules)
    E, L = num_experts, num_layers
    device = next(modules[0].parameters()).device  # NCCL reduces device tensors only
    # [L·E] tokens per (layer, expert) | aux sum, z sum, (microbatch, layer) entries, dropped |
    # [L] 1 where a rank holds that MoE layer (so dense layers stay out of the min/max)
    vec = torch.zeros(L * E + 4 + L, dtype=torch.float64, device=device)
    totals, held = vec[L * E : L * E + 4], vec[L * E + 4 :]
    forwards = []  # (layer number, a dry run's stats) of each forward here
    for layer in layers:
        i = layer.layer_number
        held[i] = 1.0
        for st, nominal in layer.pop_stats():
            forwards.append((i, nominal))
            if count_here:
                vec[i * E : (i + 1) * E] += st[:E]
                totals += torch.stack([st[E], st[E + 1], st.new_ones(()), st[E + 2]])
    mappings.all_reduce(vec, group or dist.group.WORLD, kind="all_reduce_report")
    here = [layer.layer_number for layer in layers]
    values = host.read(vec, lambda: _own_share(L, E, here, forwards))
    counts = [c for i in range(L) if values[L * E + 4 + i] > 0 for c in values[i * E : (i + 1) * E]]
    aux, z, entries, dropped = values[L * E : L * E + 4]
    out = {
        "aux_loss": aux / max(entries, 1.0),
        "tokens_per_expert_min": int(min(counts, default=0.0)),
        "tokens_per_expert_max": int(max(counts, default=0.0)),
        "dropped_tokens": int(dropped),
    }
    if with_z_loss:
        out["z_loss"] = z / max(entries, 1.0)
    return out


def _own_share(L: int, E: int, held: list[int], forwards: list) -> list[float]:
    """A dry run's `vec` in moe_metrics (no other rank to sum): this rank's layers and the
    nominal stats of its own forwards, whether or not it is the rank that counts them."""
    vec = [0.0] * (L * E + 4 + L)
    for i in held:
        vec[L * E + 4 + i] = 1.0
    for i, nominal in forwards:
        st = nominal()  # [E + 3]
        for e in range(E):
            vec[i * E + e] += st[e]
        for j, v in enumerate([st[E], st[E + 1], 1.0, st[E + 2]]):
            vec[L * E + j] += v
    return vec
