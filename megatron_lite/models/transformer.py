"""Decoder-only transformer stack built from the parallel layers; activations are [s, b, h].

Shapes in comments use local sizes: s/tp under sequence parallelism (sp), n/tp heads per TP rank.
Every module is built from a `TransformerConfig` (resolved sizes and flags), the process groups
of a `ParallelMesh` and the RNG tracker; `ModelChunk` is the part of the model one pipeline
(virtual) stage owns.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.context.layout import ring_ranges
from megatron_lite.context.ring import ring_attention
from megatron_lite.context.ulysses import ulysses_attention, ulysses_kv_heads
from megatron_lite.models.attention import attention_function
from megatron_lite.models.token_context import TokenContext
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.moe.layer import MoELayer
from megatron_lite.moe.router import RouterOptions
from megatron_lite.parallel import mappings
from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.random import RNGStatesTracker, dropout
from megatron_lite.parallel.recompute import recompute


def rope_tables_at(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [..., d] (fp32) for the integer positions [...] (e.g. [s] or [s, b]), on their
    device; half-rotation convention."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = 1.0 / theta ** (exponents / head_dim)
    freqs = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [..., d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rope_tables(seq_length: int, head_dim: int, theta: float, offset: int = 0):
    """cos, sin [s, d] for the consecutive positions offset..offset+s-1."""
    return rope_tables_at(torch.arange(offset, offset + seq_length), head_dim, theta)


class Attention(nn.Module):
    """Self-attention over this rank's n/tp query heads and g/tp KV groups, with context
    parallelism when cp > 1 (the mesh's cp_a2a and cp_ring groups say which): Ulysses
    all-to-all over cp_a2a, ring attention over cp_ring, or Ulysses inside and the ring across
    (a2a+p2p): [s(/tp), b, h] -> [s(/tp), b, h].

    The head dimension d is config.head_dim (model.kv_channels), so the query width n·d may
    differ from h. With qk_layernorm each query and key head is normalized over d (RMSNorm, or
    LayerNorm for GPT; weight [d] shared by all heads, Qwen3's q_norm/k_norm) after the
    projection and before RoPE. Those weights are replicated over TP while each TP rank
    normalizes its own heads, so they are marked for the TP gradient sum (as SP norms are).

    Selective recompute of core_attn recomputes the local attention only (softmax, attention
    dropout and the weighted sum, after the Ulysses all-to-all): it keeps q, k, v and reruns
    the attention in backward under the same TP-rank dropout generator; no collective repeats.
    Ring attention keeps only q, k, v, its output and the log-sum-exp (no s² scores), so it is
    never recomputed: that would repeat the ring's sends.
    """

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh, tracker: RNGStatesTracker):
        super().__init__()
        c, tp = config, mesh.tp.size
        a2a, ring = mesh.cp_a2a.size, mesh.cp_ring.size
        self.tracker = tracker
        self.a2a_group, self.ring_group = mesh.cp_a2a.group, mesh.cp_ring.group
        self.ring_ranges = ring_ranges(c.seq_length, ring) if ring > 1 else None
        self.recompute_core = c.recomputes("core_attn") and ring == 1
        self.dropout_p, self.head_dim = c.attention_dropout, c.head_dim
        self.n_local, self.g_local = c.num_attention_heads // tp, c.num_query_groups // tp
        # under Ulysses each rank attends over 1/a2a of its heads (KV heads replicated up to a2a)
        g_attn = self.g_local if a2a == 1 else ulysses_kv_heads(self.g_local, a2a) // a2a
        self.core_attention = attention_function(
            c.attention_backend, self.n_local // a2a, g_attn, self.head_dim, c.attention_dropout
        )
        q, kv = c.num_attention_heads * self.head_dim, c.num_query_groups * self.head_dim
        common = dict(bias=c.spec.bias, sequence_parallel=c.sequence_parallel)
        self.linear_qkv = ColumnParallelLinear(
            c.hidden_size,
            [q, kv, kv],
            mesh.tp.group,
            init_std=c.init_method_std,
            gemm=c.linear_backend,
            **common,
        )
        # `sequence_parallel=True`: each TP rank's grad covers only its heads, summed over TP
        self.q_layernorm = self.k_layernorm = None
        if c.qk_layernorm:
            self.q_layernorm = c.spec.norm(self.head_dim, c.norm_eps, sequence_parallel=True)
            self.k_layernorm = c.spec.norm(self.head_dim, c.norm_eps, sequence_parallel=True)
        self.linear_proj = RowParallelLinear(
            q, c.hidden_size, mesh.tp.group, init_std=c.output_std, gemm=c.linear_backend, **common
        )

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        d, n, g = self.head_dim, self.n_local, self.g_local
        rope = ctx.rope
        qkv = self.linear_qkv(x)  # [s, b, (n + 2g)·d] with n, g per TP rank
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([n * d, g * d, g * d], dim=-1)
        q, k, v = q.view(s, b, n, d), k.view(s, b, g, d), v.view(s, b, g, d)
        if self.q_layernorm is not None:  # per head, over d
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = kernels.apply_rope(q, *rope), kernels.apply_rope(k, *rope)
        p = self.dropout_p
        with self.tracker.fork() if p > 0 else contextlib.nullcontext():
            out = self.attention_over_cp(q, k, v, p, ctx.docs)  # [s, b, n, d]
        return self.linear_proj(out.reshape(s, b, n * d))  # [s(/tp), b, h]

    def attention_over_cp(self, q, k, v, dropout_p: float, docs=None) -> torch.Tensor:
        """Local attention (or the ring over cp_ring), inside Ulysses' all-to-all over cp_a2a
        when that group has more than one rank; docs [b, s]: the full sequence's document ids
        (None: plain causal)."""

        def core(q_, k_, v_, docs=None):
            if self.ring_ranges is not None:  # dropout_p is 0 (validation)
                return ring_attention(q_, k_, v_, self.ring_group, self.ring_ranges, docs)
            args = (q_, k_, v_, dropout_p) + (() if docs is None else (docs,))
            if self.recompute_core:
                return recompute(self.core_attention, *args, tracker=self.tracker)
            return self.core_attention(*args)

        if mappings.size(self.a2a_group) == 1:
            return core(q, k, v, docs)
        return ulysses_attention(q, k, v, self.a2a_group, core, docs=docs)


class MLP(nn.Module):
    """fc1 (column-parallel; [gate, up] segments when gated) -> SwiGLU or GeLU -> fc2
    (row-parallel): [s(/tp), b, h] -> [s(/tp), b, h]."""

    def __init__(self, config: TransformerConfig, tp_group, ffn_hidden_size: int | None = None):
        super().__init__()
        c, ffn = config, ffn_hidden_size or config.ffn_hidden_size
        self.gated = c.spec.gated_mlp
        out = [ffn, ffn] if self.gated else ffn  # SwiGLU: [gate, up] segments
        sp, gemm = c.sequence_parallel, c.linear_backend
        common = dict(bias=c.spec.bias, sequence_parallel=sp, gemm=gemm)
        self.linear_fc1 = ColumnParallelLinear(
            c.hidden_size, out, tp_group, init_std=c.init_method_std, **common
        )
        self.linear_fc2 = RowParallelLinear(
            ffn, c.hidden_size, tp_group, init_std=c.output_std, **common
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)  # [s, b, ffn/tp] (×2 gated)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = kernels.swiglu(gate, up)
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)  # [s(/tp), b, h]


def build_mlp(config: TransformerConfig, mesh: ParallelMesh, layer_number: int) -> nn.Module:
    """The dense MLP, or an MoELayer on the MoE layers of a model with experts."""
    c, shared = config, config.moe_shared_expert_ffn_hidden_size
    if not c.is_moe_layer(layer_number):
        return MLP(c, mesh.tp.group)
    return MoELayer(
        c.hidden_size,
        c.moe_ffn_hidden_size,
        c.num_experts,
        c.moe_router_topk,
        ep_group=mesh.ep.group,
        token_groups=([mesh.tp.group] if c.sequence_parallel else []) + [mesh.cp.group],
        sequence_parallel=c.sequence_parallel,
        gated=c.spec.gated_mlp,
        aux_loss_coeff=c.moe_aux_loss_coeff,
        z_loss_coeff=c.moe_z_loss_coeff,
        aux_loss_scale=c.moe_aux_loss_scale,
        capacity_factor=c.moe_capacity_factor,
        init_std=c.init_method_std,
        output_std=c.output_std,
        layer_number=layer_number,
        router_options=RouterOptions(
            score_function=c.moe_router_score_function,
            topk_scaling_factor=c.moe_router_topk_scaling_factor,
            norm_topk=c.moe_router_norm_topk,
            enable_expert_bias=c.moe_router_enable_expert_bias,
            bias_update_rate=c.moe_router_bias_update_rate,
            aux_loss_type=c.moe_aux_loss_type,
            num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk,
        ),
        grouped_gemm=c.moe_grouped_gemm,
        shared_expert=MLP(c, mesh.tp.group, shared) if shared else None,
        shared_expert_overlap=c.moe_shared_expert_overlap,
    )


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(·)); [s(/tp), b, h].

    Selective recompute of mlp (dense layers) or moe (MoE layers) keeps the MLP's input and
    reruns the whole MLP in backward (its TP gathers, and the MoE dispatch all-to-alls, too).
    """

    def __init__(
        self,
        config: TransformerConfig,
        mesh: ParallelMesh,
        tracker: RNGStatesTracker,
        layer_number: int,
    ):
        super().__init__()
        c = config
        self.tracker, self.sp, self.dropout_p = tracker, c.sequence_parallel, c.hidden_dropout
        self.input_norm = c.spec.norm(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.self_attention = Attention(c, mesh, tracker)
        self.pre_mlp_norm = c.spec.norm(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.mlp = build_mlp(c, mesh, layer_number)
        self.recompute_mlp = c.recomputes("moe" if c.is_moe_layer(layer_number) else "mlp")

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        p, tracker, sp = self.dropout_p, self.tracker, self.sp
        attn = dropout(self.self_attention(self.input_norm(x), ctx), p, tracker, sp)
        normed, x = self.pre_mlp_norm(attn, residual=x)  # x <- x + attn
        if self.recompute_mlp:
            out = recompute(self.mlp, normed, tracker=tracker)
        else:
            out = self.mlp(normed)
        return x + dropout(out, p, tracker, sp)  # [s(/tp), b, h]
