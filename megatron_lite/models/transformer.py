"""Decoder-only transformer stack built from the parallel layers; activations are [s, b, h].

Shapes in comments use local sizes: s/tp under sequence parallelism (sp), n/tp heads per TP rank.
`ModelSpec` holds what differs between Llama-style and GPT-style models; `ModelChunk` is the
part of the model one pipeline (virtual) stage owns.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite import kernels
from megatron_lite.config import Config
from megatron_lite.context.ulysses import ulysses_attention
from megatron_lite.models.backends import (
    attention_function,
    fp8_autocast,
    fp8_recipe,
    resolve_attention_backend,
    resolve_linear_backend,
)
from megatron_lite.parallel import mappings
from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import scaled_std, set_meta
from megatron_lite.parallel.random import RNGStatesTracker


@dataclass(frozen=True)
class ModelSpec:
    norm: type  # RMSNorm | LayerNorm
    bias: bool  # biases in linear layers
    gated_mlp: bool  # SwiGLU (gate, up) or a plain GeLU MLP
    rotary: bool  # rotary embeddings, else learned absolute positions


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


def rope_tables(seq_length: int, head_dim: int, theta: float, offset: int = 0):
    """cos, sin [s, d] for positions offset..offset+s-1, half-rotation convention."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    pos = torch.arange(offset, offset + seq_length, dtype=torch.float64)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


class Context:
    """What every layer of one rank shares: config, groups, RNG tracker."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, tracker: RNGStatesTracker):
        self.cfg, self.mesh, self.tracker = cfg, mesh, tracker
        self.sp = cfg.parallel.sequence_parallel and mesh.tp_size > 1
        m = cfg.model
        self.attention_backend = resolve_attention_backend(m.attention_backend, cfg.train.precision)
        self.linear_backend = resolve_linear_backend(m.linear_backend, m.fp8, m.fp8_recipe)
        self.fp8_recipe = None if m.fp8 is None else fp8_recipe(m.fp8, m.fp8_recipe)

    def fp8(self):
        """Context for the transformer layers: FP8 GEMMs in TE linears when model.fp8 is set
        (the embedding, output layer and loss stay outside it, in bf16/fp32)."""
        if self.fp8_recipe is None:
            return contextlib.nullcontext()
        return fp8_autocast(self.fp8_recipe, self.mesh.tp_dp_cp_group)

    def dropout(self, x: torch.Tensor, p: float, tp_region: bool) -> torch.Tensor:
        """Dropout; activations that differ per TP rank use the TP-rank RNG state."""
        if p == 0.0 or not torch.is_grad_enabled():
            return x
        fork = self.tracker.fork() if tp_region else contextlib.nullcontext()
        with fork:
            return F.dropout(x, p, training=True)


class Attention(nn.Module):
    def __init__(self, ctx: Context, spec: ModelSpec):
        super().__init__()
        m, tp = ctx.cfg.model, ctx.mesh.tp_size
        self.ctx, self.spec = ctx, spec
        self.head_dim = m.hidden_size // m.num_attention_heads
        self.n_local, self.g_local = m.num_attention_heads // tp, m.num_query_groups // tp
        cp = ctx.mesh.cp_size  # under Ulysses each rank attends over 1/cp of its heads
        g_attn = self.g_local if cp == 1 else max(self.g_local, cp) // cp
        self.core_attention = attention_function(
            ctx.attention_backend, self.n_local // cp, g_attn, self.head_dim, m.attention_dropout
        )
        q, kv = m.num_attention_heads * self.head_dim, m.num_query_groups * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            m.hidden_size,
            [q, kv, kv],
            ctx.mesh.tp_group,
            bias=spec.bias,
            sequence_parallel=ctx.sp,
            init_std=m.init_method_std,
            gemm=ctx.linear_backend,
        )
        self.linear_proj = RowParallelLinear(
            q,
            m.hidden_size,
            ctx.mesh.tp_group,
            bias=spec.bias,
            sequence_parallel=ctx.sp,
            init_std=scaled_std(m.init_method_std, m.num_layers),
            gemm=ctx.linear_backend,
        )

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        d, n, g = self.head_dim, self.n_local, self.g_local
        qkv = self.linear_qkv(x)  # [s, b, (n + 2g)·d] with n, g per TP rank
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([n * d, g * d, g * d], dim=-1)
        q, k, v = q.view(s, b, n, d), k.view(s, b, g, d), v.view(s, b, g, d)
        if rope is not None:
            q, k = kernels.apply_rope(q, *rope), kernels.apply_rope(k, *rope)
        p = self.ctx.cfg.model.attention_dropout
        with self.ctx.tracker.fork() if p > 0 else contextlib.nullcontext():
            out = self.attention_over_cp(q, k, v, p)  # [s, b, n, d]
        return self.linear_proj(out.reshape(s, b, n * d))  # [s(/tp), b, h]

    def attention_over_cp(self, q, k, v, dropout_p: float) -> torch.Tensor:
        """Local attention, or Ulysses all-to-all attention over the CP group when cp > 1."""
        if self.ctx.mesh.cp_size == 1:
            return self.core_attention(q, k, v, dropout_p)
        return ulysses_attention(
            q,
            k,
            v,
            self.ctx.mesh.cp_group,
            lambda q_, k_, v_: self.core_attention(q_, k_, v_, dropout_p),
        )


class MLP(nn.Module):
    def __init__(self, ctx: Context, spec: ModelSpec, ffn_hidden_size: int | None = None):
        super().__init__()
        m, group = ctx.cfg.model, ctx.mesh.tp_group
        ffn = ffn_hidden_size or m.ffn_hidden_size
        self.gated = spec.gated_mlp
        out = [ffn, ffn] if spec.gated_mlp else ffn  # SwiGLU: [gate, up] segments
        self.linear_fc1 = ColumnParallelLinear(
            m.hidden_size,
            out,
            group,
            bias=spec.bias,
            sequence_parallel=ctx.sp,
            init_std=m.init_method_std,
            gemm=ctx.linear_backend,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            m.hidden_size,
            group,
            bias=spec.bias,
            sequence_parallel=ctx.sp,
            init_std=scaled_std(m.init_method_std, m.num_layers),
            gemm=ctx.linear_backend,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)  # [s, b, ffn/tp] (×2 gated)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = kernels.swiglu(gate, up)
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)  # [s(/tp), b, h]


class TransformerLayer(nn.Module):
    def __init__(self, ctx: Context, spec: ModelSpec, layer_number: int):
        super().__init__()
        m = ctx.cfg.model
        self.ctx = ctx
        self.input_norm = spec.norm(m.hidden_size, m.norm_eps, ctx.sp)
        self.self_attention = Attention(ctx, spec)
        self.pre_mlp_norm = spec.norm(m.hidden_size, m.norm_eps, ctx.sp)
        self.mlp = build_mlp(ctx, spec, layer_number)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        p = self.ctx.cfg.model.hidden_dropout
        attn = self.ctx.dropout(self.self_attention(self.input_norm(x), rope), p, self.ctx.sp)
        normed, x = self.pre_mlp_norm(attn, residual=x)  # x <- x + attn
        return x + self.ctx.dropout(self.mlp(normed), p, self.ctx.sp)  # [s(/tp), b, h]


def build_mlp(ctx: Context, spec: ModelSpec, layer_number: int) -> nn.Module:
    m = ctx.cfg.model
    if m.num_experts is not None and layer_number % m.moe_layer_freq == 0:
        from megatron_lite.moe.layer import MoELayer

        return MoELayer(ctx, spec)
    return MLP(ctx, spec)


class ModelChunk(nn.Module):
    """Layers `layer_ids` (global numbers) plus the embedding on the first stage and the final
    norm, output layer and loss on the last.

    forward(x, labels): x is token ids [b, s] on the first stage, else the hidden state
    [s(/tp), b, h] from the previous stage; returns the per-token loss [s/cp, b] on the last
    stage, else the hidden state for the next one.
    """

    def __init__(
        self,
        ctx: Context,
        spec: ModelSpec,
        layer_ids: list[int],
        vocab_size: int,
        pre_process: bool,
        post_process: bool,
    ):
        super().__init__()
        m, mesh = ctx.cfg.model, ctx.mesh
        self.ctx, self.spec, self.pre_process, self.post_process = (
            ctx,
            spec,
            pre_process,
            post_process,
        )
        self.padded_vocab = padded_vocab_size(
            vocab_size, m.make_vocab_size_divisible_by, mesh.tp_size
        )
        self.vocab_size = vocab_size
        s_local = m.seq_length // mesh.cp_size
        if pre_process:
            self.embedding = VocabParallelEmbedding(
                vocab_size,
                self.padded_vocab,
                m.hidden_size,
                mesh.tp_group,
                init_std=m.init_method_std,
            )
            if not spec.rotary:
                max_pos = m.max_position_embeddings or m.seq_length
                self.position_embeddings = set_meta(
                    nn.Parameter(torch.empty(max_pos, m.hidden_size)),
                    full_shape=(max_pos, m.hidden_size),
                    std=m.init_method_std,
                    sequence_parallel=ctx.sp,
                )
        self.layers = nn.ModuleDict({str(i): TransformerLayer(ctx, spec, i) for i in layer_ids})
        if post_process:
            self.final_norm = spec.norm(m.hidden_size, m.norm_eps, ctx.sp)
            tied_here = m.tie_embeddings and pre_process
            self.output_layer = ColumnParallelLinear(
                m.hidden_size,
                self.padded_vocab,
                mesh.tp_group,
                bias=False,
                sequence_parallel=ctx.sp,
                init_std=m.init_method_std,
                skip_weight=tied_here,
            )
            if self.output_layer.weight is not None:  # its own weight, vocabulary-padded
                meta = self.output_layer.weight.meta
                meta.full_shape, meta.padded, meta.segments = (
                    (vocab_size, m.hidden_size),
                    self.padded_vocab,
                    None,
                )
                if m.tie_embeddings:  # tied copy on the last stage: same init, synced grads
                    meta.tied_copy, meta.init_name = True, "embedding.weight"
            v_local = self.padded_vocab // mesh.tp_size
            cols = torch.arange(v_local) + mesh.tp_rank * v_local
            self.register_buffer("vocab_pad_mask", cols >= vocab_size, persistent=False)
            self.has_vocab_pad = bool(self.vocab_pad_mask.any())
        self.cp_offset = mesh.cp_rank * s_local
        self.s_local = s_local
        if spec.rotary:
            head_dim = m.hidden_size // m.num_attention_heads
            cos, sin = rope_tables(s_local, head_dim, m.rope_theta, offset=self.cp_offset)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [s/cp(/tp), b, h]."""
        ids = ids.t()[self.cp_offset : self.cp_offset + self.s_local]  # [s/cp, b]
        x = self.embedding(ids)  # [s/cp, b, h] partial sums over TP
        tp_group = self.ctx.mesh.tp_group
        if self.ctx.sp:
            x = mappings.reduce_scatter_to_sequence_parallel_region(x, tp_group)  # [s/cp/tp]
        else:
            x = mappings.reduce_from_tensor_parallel_region(x, tp_group)
        if not self.spec.rotary:
            start, n = self.cp_offset, x.shape[0]
            if self.ctx.sp:
                start += self.ctx.mesh.tp_rank * n
            x = x + self.position_embeddings[start : start + n].unsqueeze(1)
        return self.ctx.dropout(x, self.ctx.cfg.model.hidden_dropout, self.ctx.sp)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_process:
            x = self.embed(x)
        rope = (self.rope_cos, self.rope_sin) if self.spec.rotary else None
        with self.ctx.fp8():
            for layer in self.layers.values():
                x = layer(x, rope)
        if not self.post_process:
            return x
        return self.loss(self.final_norm(x), labels)

    def output_weight(self) -> torch.Tensor:
        w = self.output_layer.weight
        return self.embedding.weight if w is None else w

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """x [s/cp(/tp), b, h], labels [b, s] -> per-token loss [s/cp, b]."""
        logits = self.output_layer(x, self.output_weight())  # [s/cp, b, V/tp]
        if self.has_vocab_pad:  # padded vocabulary never takes probability mass
            logits = logits.masked_fill(self.vocab_pad_mask, float("-inf"))
        labels = labels.t()[self.cp_offset : self.cp_offset + self.s_local]  # [s/cp, b]
        return vocab_parallel_cross_entropy(logits.float(), labels, self.ctx.mesh.tp_group)
