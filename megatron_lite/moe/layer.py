"""The MoE layer (router -> dispatcher -> local experts -> combine) and its per-step metrics.

Aux-loss scaling: the trained objective is
    Σ token CE / N_global + coeff · mean over (microbatches of the global batch, MoE layers) of
    aux_mb (+ z_coeff · the same mean of z_mb),
so each microbatch's aux term gets gradient 1 / (num_microbatches · dp · num_moe_layers) — a
constant of the config, the same on every layout. Gradients of the router are then summed over
dp×cp (and over TP under sequence parallelism) by the gradient finalizer like any other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import Config
from megatron_lite.moe.dispatcher import AllToAllTokenDispatcher
from megatron_lite.moe.experts import LocalExperts
from megatron_lite.moe.router import MoEAuxLossAutoScaler, TopKRouter
from megatron_lite.parallel import mappings
from megatron_lite.parallel.params import scaled_std
from megatron_lite.validation import num_microbatches


def is_moe_layer(cfg: Config, layer_number: int) -> bool:
    m = cfg.model
    return m.num_experts is not None and layer_number % m.moe_layer_freq == 0


def num_moe_layers(cfg: Config) -> int:
    return sum(is_moe_layer(cfg, i) for i in range(cfg.model.num_layers))


class MoELayer(nn.Module):
    """Drop-in replacement of the MLP: [s/cp(/tp), b, h] -> same shape.

    Each rank routes its own tokens (its sequence shard under CP/SP); experts are spread over
    the EP group, the router is replicated. Per forward it appends microbatch-global statistics
    (tokens per expert, aux loss, z-loss, dropped assignments) that `moe_metrics` collects.
    """

    def __init__(self, ctx, spec):
        super().__init__()
        cfg, mesh = ctx.cfg, ctx.mesh
        m = cfg.model
        token_groups = ([mesh.tp_group] if ctx.sp else []) + [mesh.cp_group]
        self.router = TopKRouter(
            m.hidden_size,
            m.num_experts,
            m.moe_router_topk,
            aux_loss_coeff=m.moe_aux_loss_coeff,
            z_loss_coeff=m.moe_z_loss_coeff,
            capacity_factor=m.moe_capacity_factor,
            token_groups=token_groups,
            sequence_parallel=ctx.sp,
            init_std=m.init_method_std,
        )
        self.experts = LocalExperts(
            m.num_experts,
            m.hidden_size,
            m.moe_ffn_hidden_size or m.ffn_hidden_size,
            ep_rank=mesh.ep_rank,
            ep_size=mesh.ep_size,
            gated=spec.gated_mlp,
            sequence_parallel=ctx.sp,
            init_std=m.init_method_std,
            output_std=scaled_std(m.init_method_std, m.num_layers),
        )
        self.dispatcher = AllToAllTokenDispatcher(m.num_experts, mesh.ep_group)
        self.aux_scale = 1.0 / (num_microbatches(cfg) * cfg.parallel.dp * num_moe_layers(cfg))
        self.stats: list[torch.Tensor] = []  # float64 [E + 3] per forward since the last pop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)  # [T, h], T = s/cp(/tp)·b in (s, b) order
        route = self.router(tokens)
        expert_in, counts, handle = self.dispatcher.dispatch(
            tokens, route.indices, route.weights, route.keep
        )
        expert_out = self.experts(expert_in, counts).to(x.dtype)  # [N_recv, h]
        out = self.dispatcher.combine(expert_out, handle).view(s, b, h)
        if route.objective is not None and out.requires_grad:
            out = MoEAuxLossAutoScaler.apply(out, route.objective, self.aux_scale)
        self.stats.append(route.stats)
        return out

    def pop_stats(self) -> list[torch.Tensor]:
        stats, self.stats = self.stats, []
        return stats


def moe_metrics(chunks, mesh) -> dict:
    """Step metrics of every MoE layer, reduced over the whole world with one all-reduce.

    Call on every rank once per step (after the forward/backward passes): aux_loss (the
    unscaled load-balancing loss, 1.0 = uniform, mean over the microbatches of the global batch
    and the MoE layers), z_loss (same mean, only when moe_z_loss_coeff > 0),
    tokens_per_expert_min/_max (token assignments per expert summed over the global batch,
    before capacity dropping; min/max over every (layer, expert)) and dropped_tokens
    (assignments dropped over capacity, summed over the global batch and layers).
    """
    cfg = chunks[0].ctx.cfg
    E, L = cfg.model.num_experts, cfg.model.num_layers
    device = next(chunks[0].parameters()).device  # NCCL reduces device tensors only
    # [L·E] tokens per (layer, expert) | aux sum, z sum, (microbatch, layer) entries, dropped
    vec = torch.zeros(L * E + 4, dtype=torch.float64, device=device)
    # statistics are microbatch-global, identical on its TP and CP ranks: count them once
    owner = mesh.tp_rank == 0 and mesh.cp_rank == 0
    for chunk in chunks:
        for name, layer in chunk.layers.items():
            if not isinstance(layer.mlp, MoELayer):
                continue
            for st in layer.mlp.pop_stats():
                if owner:
                    i = int(name)
                    vec[i * E : (i + 1) * E] += st[:E]
                    vec[L * E :] += torch.stack([st[E], st[E + 1], st.new_ones(()), st[E + 2]])
    mappings.all_reduce(vec, dist.group.WORLD, kind="all_reduce_report")
    counts = vec[: L * E].view(L, E).cpu()[[is_moe_layer(cfg, i) for i in range(L)]]
    aux, z, entries, dropped = vec[L * E :].tolist()
    out = {
        "aux_loss": aux / max(entries, 1.0),
        "tokens_per_expert_min": int(counts.min().item()),
        "tokens_per_expert_max": int(counts.max().item()),
        "dropped_tokens": int(dropped),
    }
    if cfg.model.moe_z_loss_coeff:
        out["z_loss"] = z / max(entries, 1.0)
    return out
