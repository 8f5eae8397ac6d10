"""Decoder-only transformer stack built from the parallel layers; activations are [s, b, h].

Shapes in comments use local sizes: s/tp under sequence parallelism (sp), n/tp heads per TP rank.
Every module is built from a `TransformerConfig` (resolved sizes and flags, and in `spec` the
architecture's registry entry), the process groups of a `ParallelMesh` and the RNG tracker. The
parts here are the shipped entries' (models/llama.py, gpt.py): `Attention` (GPT) and
`RotaryAttention` (Llama; both with the KV-cached decoding of models/attention.py when handed a
`DecodeContext`), the dense `MLP` and `MoELayer` builders, and `TransformerLayer`, the
pre-norm sequential residual layer any entry gets unless it names its own; `build_layer` builds
the entry's layer (the model chunk and the planner call it). The parts' constructor contracts
are models/registry.py's.
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
from megatron_lite.models import rope_scaling
from megatron_lite.models.attention import DecodeContext, attention_function, cached_attention
from megatron_lite.models.registry import HeadDims
from megatron_lite.models.token_context import TokenContext
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.moe.layer import MoELayer
from megatron_lite.moe.router import RouterOptions
from megatron_lite.parallel import mappings
from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.random import RNGStatesTracker, dropout
from megatron_lite.parallel.recompute import recompute


def rope_tables_at(
    positions: torch.Tensor, rotary_dim: int, theta: float, scaling: dict | None = None
):
    """cos, sin [..., r] (fp32, r = rotary_dim: the attention part's declared rotary width) for
    the integer positions [...] (e.g. [s] or [s, b]), on their device; half-rotation
    convention. `scaling`: model.rope_scaling (YaRN's frequencies and its attention factor on
    cos and sin, models/rope_scaling.py), None for plain RoPE."""
    inv_freq = rope_scaling.inv_freq(rotary_dim, theta, scaling).to(positions.device)
    freqs = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [..., d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = rope_scaling.attention_factor(scaling)
    return (emb.cos() * factor).float(), (emb.sin() * factor).float()


def rope_tables(
    seq_length: int, rotary_dim: int, theta: float, offset: int = 0, scaling: dict | None = None
):
    """cos, sin [s, r] for the consecutive positions offset..offset+s-1."""
    return rope_tables_at(torch.arange(offset, offset + seq_length), rotary_dim, theta, scaling)


class Region(nn.Module):
    """A named call in the module tree, `Region()(fn, *args) = fn(*args)`: a point that module
    hooks (activation offload) can wrap where the work is a function, not a module."""

    def forward(self, fn, *args):
        return fn(*args)


class AttentionCore(nn.Module):
    """What every attention kind here shares: the local attention of this rank's n/tp query
    heads over `kv_heads`/tp KV heads, with context parallelism when cp > 1 (the mesh's cp_a2a
    and cp_ring groups say which): Ulysses all-to-all over cp_a2a, ring attention over cp_ring,
    or Ulysses inside and the ring across (a2a+p2p), and KV-cached decoding when handed a
    `DecodeContext`. A subclass builds its projections and calls `attend(q, k, v, ctx)` on
    q [s, b, n/tp, dk], k [s, b, g/tp, dk], v [s, b, g/tp, dv] (its `head_dims`), which gives
    [s, b, n/tp, dv]; the softmax scale is 1/sqrt(dk).

    Selective recompute of core_attn recomputes the local attention only (softmax, attention
    dropout and the weighted sum, after the Ulysses all-to-all): it keeps q, k, v and reruns
    the attention in backward under the same TP-rank dropout generator; no collective repeats.
    Ring attention keeps only q, k, v, its output and the log-sum-exp (no s² scores), so it is
    never recomputed: that would repeat the ring's sends.
    """

    def __init__(
        self,
        config: TransformerConfig,
        mesh: ParallelMesh,
        tracker: RNGStatesTracker,
        kv_heads: int,
    ):
        super().__init__()
        c, tp, dims = config, mesh.tp.size, self.head_dims(config)
        a2a, ring = mesh.cp_a2a.size, mesh.cp_ring.size
        self.tracker = tracker
        self.a2a_group, self.ring_group = mesh.cp_a2a.group, mesh.cp_ring.group
        self.ring_ranges = ring_ranges(c.seq_length, ring) if ring > 1 else None
        self.recompute_core = c.recomputes("core_attn") and ring == 1
        self.dropout_p, self.qk_dim, self.v_dim = c.attention_dropout, dims.qk, dims.v
        self.n_local, self.g_local = c.num_attention_heads // tp, kv_heads // tp
        # under Ulysses each rank attends over 1/a2a of its heads (KV heads replicated up to a2a)
        g_attn = self.g_local if a2a == 1 else ulysses_kv_heads(self.g_local, a2a) // a2a
        self.core_attention = attention_function(
            c.attention_backend, self.n_local // a2a, g_attn, (dims.qk, dims.v), c.attention_dropout
        )
        self.core_attn = Region()  # the core attention's hook point (activation offload)

    def offload_parts(self) -> dict[str, nn.Module]:
        """The parts activation offload may name (parallel/activation_offload.py) that this
        attention has and does not recompute."""
        parts = {} if self.recompute_core else {"core_attn": self.core_attn}
        for name, attr in (
            ("qkv_linear", "linear_qkv"),
            ("attn_proj", "linear_proj"),
            ("attn_proj", "o_proj"),
        ):
            if isinstance(getattr(self, attr, None), nn.Module):
                parts[name] = getattr(self, attr)
        return parts

    @classmethod
    def head_dims(cls, config: TransformerConfig) -> HeadDims:
        raise NotImplementedError

    def attend(self, q, k, v, ctx: TokenContext) -> torch.Tensor:
        """Causal attention of q over k, v (class docstring) -> [s, b, n/tp, dv]."""
        if isinstance(ctx, DecodeContext):  # generation: over the cached positions too
            return self.decode_attention(q, k, v, ctx)
        p = self.dropout_p
        with self.tracker.fork() if p > 0 else contextlib.nullcontext():
            return self.attention_over_cp(q, k, v, p, ctx.docs)

    def decode_attention(self, q, k, v, ctx: DecodeContext) -> torch.Tensor:
        """This step's k/v [s, b, g, d] join the cache; q attends over every cached position
        the mask allows (no dropout) -> [s, b, n, dv]. Whole sequences only: no CP."""
        if self.ring_ranges is not None or mappings.size(self.a2a_group) > 1:
            raise ValueError(
                "KV-cached decoding runs on a model built with cp=1 (each rank holds the whole "
                "sequence). Fix: build the generation model with parallel.cp=1"
            )
        k, v = ctx.kv_cache.extend(self, k, v)  # [length + s, b, g, d]
        return cached_attention(q, k, v, ctx.mask)

    def attention_over_cp(self, q, k, v, dropout_p: float, docs=None) -> torch.Tensor:
        """Local attention (or the ring over cp_ring), inside Ulysses' all-to-all over cp_a2a
        when that group has more than one rank; docs [b, s]: the full sequence's document ids
        (None: plain causal)."""

        def local(q_, k_, v_, docs=None):
            if self.ring_ranges is not None:  # dropout_p is 0 (validation)
                return ring_attention(q_, k_, v_, self.ring_group, self.ring_ranges, docs)
            args = (q_, k_, v_, dropout_p) + (() if docs is None else (docs,))
            if self.recompute_core:
                return recompute(self.core_attention, *args, tracker=self.tracker)
            return self.core_attention(*args)

        def core(q_, k_, v_, docs=None):
            return self.core_attn(local, q_, k_, v_, docs)

        if mappings.size(self.a2a_group) == 1:
            return core(q, k, v, docs)
        return ulysses_attention(q, k, v, self.a2a_group, core, docs=docs)


class Attention(AttentionCore):
    """Self-attention (grouped-query when model.num_query_groups < heads) built on
    `AttentionCore`: [s(/tp), b, h] -> [s(/tp), b, h]. No RoPE (GPT's; `RotaryAttention` is
    Llama's).

    With model.add_qkv_bias (Qwen2) the q, k and v projections have biases and the output
    projection none (Megatron's add_qkv_bias); the entry's `bias` puts them everywhere (GPT).

    Head widths come from `head_dims(config)`: q/k and v are both config.head_dim
    (model.kv_channels), so the query width n·d may differ from h. With qk_layernorm each
    query and key head is normalized over d (the entry's norm: RMSNorm, or LayerNorm for GPT;
    weight [d] shared by all heads, Qwen3's q_norm/k_norm) after the projection and before
    RoPE. Those weights are replicated over TP while each TP rank normalizes its own heads, so
    they are marked for the TP gradient sum (as SP norms are).
    """

    rotary = False  # whether RoPE rotates each q/k head (over all of its dims)

    @classmethod
    def head_dims(cls, config: TransformerConfig) -> HeadDims:
        """q/k and v head widths and the rotary width (registry.py's contract)."""
        d = config.head_dim
        return HeadDims(qk=d, v=d, rotary=d if cls.rotary else 0)

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh, tracker: RNGStatesTracker):
        super().__init__(config, mesh, tracker, config.num_query_groups)
        c, dims = config, self.head_dims(config)
        n, g = c.num_attention_heads, c.num_query_groups
        q, k, v = n * dims.qk, g * dims.qk, g * dims.v
        common = dict(bias=c.spec.bias, sequence_parallel=c.sequence_parallel)
        self.linear_qkv = ColumnParallelLinear(
            c.hidden_size,
            [q, k, v],
            mesh.tp.group,
            init_std=c.init_method_std,
            gemm=c.linear_backend,
            **(common | {"bias": c.spec.bias or c.add_qkv_bias}),  # Qwen2: q/k/v only
        )
        # `sequence_parallel=True`: each TP rank's grad covers only its heads, summed over TP
        self.q_layernorm = self.k_layernorm = None
        if c.qk_layernorm:
            norm = c.spec.part("norm")
            self.q_layernorm = norm(dims.qk, c.norm_eps, sequence_parallel=True)
            self.k_layernorm = norm(dims.qk, c.norm_eps, sequence_parallel=True)
        self.linear_proj = RowParallelLinear(
            n * dims.v, c.hidden_size, mesh.tp.group, init_std=c.output_std,
            gemm=c.linear_backend, **common,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        dk, dv, n, g = self.qk_dim, self.v_dim, self.n_local, self.g_local
        rope = ctx.rope
        qkv = self.linear_qkv(x)  # [s, b, n·dk + g·(dk + dv)] with n, g per TP rank
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([n * dk, g * dk, g * dv], dim=-1)
        q, k, v = q.view(s, b, n, dk), k.view(s, b, g, dk), v.view(s, b, g, dv)
        if self.q_layernorm is not None:  # per head, over dk
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = kernels.apply_rope(q, *rope), kernels.apply_rope(k, *rope)
        out = self.attend(q, k, v, ctx)  # [s, b, n, dv]
        return self.linear_proj(out.reshape(s, b, n * dv))  # [s(/tp), b, h]


class RotaryAttention(Attention):
    """`Attention` with rotary position embeddings over each whole q/k head (Llama's): the
    model chunk builds the cos/sin tables at `head_dims(config).rotary` and hands them in the
    TokenContext."""

    rotary = True


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


def build_dense_mlp(config: TransformerConfig, mesh: ParallelMesh) -> nn.Module:
    """The shipped entries' dense MLP part (registry contract: config, mesh)."""
    return MLP(config, mesh.tp.group)


def build_moe(config: TransformerConfig, mesh: ParallelMesh, layer_number: int) -> nn.Module:
    """The shipped entries' MoE part: routed experts over the EP group (SwiGLU or GeLU as the
    entry's gated_mlp says), plus a shared expert when model.moe_shared_expert_ffn_hidden_size
    is set, gated with model.moe_shared_expert_gate (registry contract: config, mesh,
    layer_number)."""
    c, shared = config, config.moe_shared_expert_ffn_hidden_size
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
            group_score=c.moe_router_group_score,
        ),
        grouped_gemm=c.moe_grouped_gemm,
        shared_expert=MLP(c, mesh.tp.group, shared) if shared else None,
        shared_expert_overlap=c.moe_shared_expert_overlap,
        shared_expert_gate=c.moe_shared_expert_gate,
    )


def build_mlp(config: TransformerConfig, mesh: ParallelMesh, layer_number: int) -> nn.Module:
    """The entry's MoE part on the layers model.moe_layer_pattern marks, else its dense MLP."""
    if config.is_moe_layer(layer_number):
        return config.spec.part("moe")(config, mesh, layer_number)
    return config.spec.part("mlp")(config, mesh)


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(·)); [s(/tp), b, h]. The
    default layer of a registry entry, built from its attention, norm and MLP / MoE parts.

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
        norm = c.spec.part("norm")
        self.input_norm = norm(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.self_attention = c.spec.part("attention")(c, mesh, tracker)
        self.pre_mlp_norm = norm(c.hidden_size, c.norm_eps, c.sequence_parallel)
        self.mlp = build_mlp(c, mesh, layer_number)
        self.recompute_mlp = c.recomputes("moe" if c.is_moe_layer(layer_number) else "mlp")

    def offload_parts(self) -> dict[str, nn.Module]:
        """{Megatron-Core offload name: submodule} of this layer for activation offload
        (parallel/activation_offload.py); the parts it recomputes are left out."""
        parts = {"attn_norm": self.input_norm, "mlp_norm": self.pre_mlp_norm}
        parts |= getattr(self.self_attention, "offload_parts", dict)()
        if not self.recompute_mlp:
            moe = isinstance(self.mlp, MoELayer)
            parts["moe_experts" if moe else "mlp"] = self.mlp.experts if moe else self.mlp
        return parts

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        p, tracker, sp = self.dropout_p, self.tracker, self.sp
        attn = dropout(self.self_attention(self.input_norm(x), ctx), p, tracker, sp)
        normed, x = self.pre_mlp_norm(attn, residual=x)  # x <- x + attn
        if self.recompute_mlp:
            out = recompute(self.mlp, normed, tracker=tracker)
        else:
            out = self.mlp(normed)
        return x + dropout(out, p, tracker, sp)  # [s(/tp), b, h]


def build_layer(
    config: TransformerConfig, mesh: ParallelMesh, tracker: RNGStatesTracker, layer_number: int
) -> nn.Module:
    """Layer `layer_number` (global, 0-based) of the architecture `config.spec`: its layer
    class (TransformerLayer unless the entry names one) built from its parts."""
    return config.spec.part("layer")(config, mesh, tracker, layer_number)
