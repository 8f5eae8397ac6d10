"""Multi-head latent attention (MLA, DeepSeek-V2 §2.1 and DeepSeek-V3), the llama entry's
attention part when model.multi_latent_attention is true, as Hugging Face transformers 5.25's
`DeepseekV3Attention` computes it. Per token x [h], with n heads, dn = model.qk_head_dim (the
no-RoPE part), dr = model.qk_pos_emb_head_dim (the decoupled RoPE part), dv = model.v_head_dim:

    q     = q_b_proj(RMSNorm_q(q_a_proj(x)))      [n, dn + dr]   (q_lora_rank set)
          = q_proj(x)                                            (q_lora_rank null: V2-Lite)
    c, kr = split(kv_a_proj_with_mqa(x), [kv_lora_rank, dr])     one matrix, as HF stores it
    k_nope, v = split(kv_b_proj(RMSNorm_kv(c)), [dn, dv])        [n, dn], [n, dv]
    q = [q_nope, RoPE(q_rope)], k = [k_nope, RoPE(kr)] (kr shared by every head)
    out = o_proj(softmax(q·kᵀ · scale) · v)                       [n·dv] -> [h]

Parameters (the names are HF's, so a checkpoint maps `self_attn.<name>.weight` to
`self_attention.<name>.weight` one to one; o_proj stands where the other attention has
linear_proj): q_proj or q_a_proj + q_a_layernorm + q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj; no biases. The norms use model.norm_eps (HF's are fixed at 1e-6, DeepSeek's
rms_norm_eps). Megatron names them linear_q_proj, linear_q_down_proj, q_layernorm,
linear_q_up_proj, linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj.

Tensor parallelism (Megatron's MLA layout): the up-projections (q_proj / q_b_proj, kv_b_proj)
are column-parallel by heads and o_proj row-parallel; the down-projections (q_a_proj,
kv_a_proj_with_mqa) and their RMSNorms are replicated over TP and run on this rank's own tokens
([s/tp] under sequence parallelism), so the up-projections gather the compressed latents
(q_lora_rank + kv_lora_rank wide) rather than the hidden state, and the RoPE key kr is gathered
apart ([s/tp, b, dr] -> [s, b, dr]; backward: reduce-scatter of its head-partial gradient).
Under SP the replicated weights' gradients cover this rank's tokens only, so they are marked
`sequence_parallel` and summed over TP as SP norms are; without SP each rank sees every token
(the up-projections all-reduce the latents' gradients) and nothing is summed.

RoPE: DeepSeek's decoupled RoPE is interleaved (pairs (x0, x1), (x2, x3), ...; HF's default
`rope_interleave`). The RoPE dims of q and kr are de-interleaved ([x0, x2, ..., x1, x3, ...]),
then rotated by the half-rotation kernel: exactly HF's `apply_rotary_pos_emb_interleave`, whose
output has that layout too. The tables are built at rotary width dr, with YaRN when
model.rope_scaling is set (models/rope_scaling.py: its attention factor on cos and sin).

Softmax scale: HF's 1/sqrt(dn + dr) · mscale(factor, mscale_all_dim)² under YaRN. The
attention backends (SDPA, flash, TE, the ring, Ulysses around any of them, and the KV-cached
decoding) all apply the default 1/sqrt(d_qk); q is multiplied by mscale² after RoPE (only when
that is not 1), which gives the same scores with no backend taking a scale argument.

Context parallelism, document masking, selective recompute of core_attn and dropout are
`AttentionCore`'s (models/transformer.py): k has n heads of width dn + dr (kr repeated per
head) and v n heads of width dv, which Ulysses and the ring read from the tensors. Full
recompute is the chunk's. fp32 and bf16 alike (the norms and RoPE compute in fp32).

Saved for backward (no recompute), per layer and microbatch: the down-projections' input x
(the input norm's output), the compressed latents before and after their norms
([s/tp, b, q_lora_rank + kv_lora_rank + dr]: the up-projections keep only the local shard under
SP), q and k (n/tp·(dn + dr) each per token), v zero-padded to dn + dr and SDPA's output
(models/attention.py) and its log-sum-exp, and o_proj's input (n/tp·dv). So this
implementation keeps per-head tensors, not only the compressed kv and the RoPE key (a
memory-aware MLA would recompute the up-projections and the attention in backward: Megatron's
recompute_modules=[mla_up_proj], not built here); selective recompute of core_attn keeps q, k
and the kv up-projection's output (v is a view of it) instead of SDPA's saves.
docs/deepseek_v3.md has the measured bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite import kernels
from megatron_lite.models import rope_scaling
from megatron_lite.models.registry import HeadDims
from megatron_lite.models.token_context import TokenContext
from megatron_lite.models.transformer import AttentionCore, RotaryAttention
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.parallel import mappings
from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.mesh import ParallelMesh
from megatron_lite.parallel.params import set_meta
from megatron_lite.parallel.random import RNGStatesTracker


def _replicated_linear(c: TransformerConfig, in_features: int, out_features: int):
    """A bias-free linear every TP rank holds whole, on its own tokens: under SP its gradient
    covers this rank's tokens only and is summed over TP (marked as SP norms are)."""
    layer = ColumnParallelLinear(
        in_features, out_features, None, bias=False, init_std=c.init_method_std,
        gemm=c.linear_backend,
    )  # fmt: skip
    set_meta(
        layer.weight,
        full_shape=(out_features, in_features),
        std=c.init_method_std,
        sequence_parallel=c.sequence_parallel,
    )
    return layer


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., r] with pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (the
    half-rotation layout of the same pairs)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLASelfAttention(AttentionCore):
    """Multi-head latent attention (module docstring): [s(/tp), b, h] -> [s(/tp), b, h]."""

    @classmethod
    def head_dims(cls, config: TransformerConfig) -> HeadDims:
        """q/k: no-RoPE + RoPE parts; v: model.v_head_dim; RoPE rotates the last dr dims."""
        c = config
        return HeadDims(
            qk=c.qk_head_dim + c.qk_pos_emb_head_dim, v=c.v_head_dim, rotary=c.qk_pos_emb_head_dim
        )

    def __init__(self, config: TransformerConfig, mesh: ParallelMesh, tracker: RNGStatesTracker):
        c = config
        super().__init__(c, mesh, tracker, c.num_attention_heads)  # every head its own k, v
        n, dn, dr, dv = c.num_attention_heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        self.nope_dim, self.rope_dim, self.kv_lora_rank = dn, dr, c.kv_lora_rank
        self.sp, self.tp_group = c.sequence_parallel, mesh.tp.group
        tp_common = dict(bias=False, sequence_parallel=c.sequence_parallel, gemm=c.linear_backend)
        up = dict(init_std=c.init_method_std, **tp_common)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, n * (dn + dr), mesh.tp.group, **up)
        else:
            self.q_a_proj = _replicated_linear(c, c.hidden_size, c.q_lora_rank)
            norm = c.spec.part("norm")
            self.q_a_layernorm = norm(c.q_lora_rank, c.norm_eps, c.sequence_parallel)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, n * (dn + dr), mesh.tp.group, **up)
        self.kv_a_proj_with_mqa = _replicated_linear(c, c.hidden_size, c.kv_lora_rank + dr)
        self.kv_a_layernorm = c.spec.part("norm")(c.kv_lora_rank, c.norm_eps, c.sequence_parallel)
        self.kv_b_proj = ColumnParallelLinear(c.kv_lora_rank, n * (dn + dv), mesh.tp.group, **up)
        self.o_proj = RowParallelLinear(
            n * dv, c.hidden_size, mesh.tp.group, init_std=c.output_std, **tp_common
        )
        # HF's softmax scale over the backends' default 1/sqrt(dn + dr), folded into q
        self.q_scale = rope_scaling.softmax_scale_factor(c.rope_scaling)

    def rope_key(self, kr: torch.Tensor) -> torch.Tensor:
        """The decoupled key [s(/tp), b, dr] of this rank's tokens -> [s, b, dr] of every token
        the up-projections see; its gradient (partial over this rank's heads) is summed over
        TP (reduce-scattered under SP)."""
        if self.sp:
            return mappings.gather_from_sequence_parallel_region(kr, self.tp_group)
        return mappings.copy_to_tensor_parallel_region(kr, self.tp_group)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        n, dn, dr, dv = self.n_local, self.nope_dim, self.rope_dim, self.v_dim
        if self.q_proj is not None:
            q = self.q_proj(x)  # [s, b, n/tp·(dn + dr)]
        else:  # down on this rank's tokens [s(/tp), b, q_lora_rank], up gathers the latent
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent, kr = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # [s, b, n/tp·(dn + dv)]
        kr = self.rope_key(kr)  # [s, b, dr]
        s, b = q.shape[:2]
        q_nope, q_rope = q.view(s, b, n, dn + dr).split([dn, dr], dim=-1)
        k_nope, v = kv.view(s, b, n, dn + dv).split([dn, dv], dim=-1)
        q_rope, kr = deinterleave(q_rope), deinterleave(kr.unsqueeze(2))  # [s, b, n|1, dr]
        if ctx.rope is not None:
            q_rope, kr = kernels.apply_rope(q_rope, *ctx.rope), kernels.apply_rope(kr, *ctx.rope)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [s, b, n, dn + dr]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, kr.expand(s, b, n, dr)], dim=-1)  # [s, b, n, dn + dr]
        out = self.attend(q, k, v, ctx)  # [s, b, n, dv]
        return self.o_proj(out.reshape(s, b, n * dv))  # [s(/tp), b, h]


@dataclass(frozen=True)
class LatentOrPlain:
    """An attention part (registry contract) that is MLA when model.multi_latent_attention is
    true and `plain` otherwise: the llama entry's, so the flag works on that architecture."""

    plain: type

    def pick(self, config: TransformerConfig) -> type:
        return MLASelfAttention if config.multi_latent_attention else self.plain

    def __call__(self, config: TransformerConfig, mesh: ParallelMesh, tracker: RNGStatesTracker):
        return self.pick(config)(config, mesh, tracker)

    def head_dims(self, config: TransformerConfig) -> HeadDims:
        return self.pick(config).head_dims(config)


LLAMA_ATTENTION = LatentOrPlain(RotaryAttention)
