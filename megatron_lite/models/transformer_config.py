"""`TransformerConfig`: the frozen, fully resolved description of one model (Megatron's name).

Every field is final: no null placeholders, backends resolved, the vocabulary padded for tp, the
effective sequence parallelism. The transformer layers and model chunks are built from it (and
from the process groups), never from the run `Config`. `from_config` copies every `ModelConfig`
field by name (their defaults live there only) and takes the derived ones from the functions of
`megatron_lite.resolve`, so it needs no prior `validate()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_lite import resolve
from megatron_lite.config import Config
from megatron_lite.models.registry import ArchitectureSpec, get_architecture
from megatron_lite.parallel.params import scaled_std

# ModelConfig fields the layers never read: folded into `spec` and `padded_vocab_size`, or
# run-level choices (compile: models/compile.py wraps the built layers)
# activation_offload*: the trainer hooks the built layers (training/step.py), the model is the same
RUN_ONLY = frozenset(
    {
        "arch",
        "make_vocab_size_divisible_by",
        "compile",
        "compile_mode",
        "activation_offload",
        "activation_offload_inflight",
        "activation_offload_min_bytes",
    }
)


@dataclass(frozen=True)
class TransformerConfig:
    """One model's sizes and flags, resolved; a field named as in ModelConfig takes its value."""

    spec: ArchitectureSpec  # model.arch's registry entry: the parts, their options (registry.py)
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # the head dimension, resolved
    qk_layernorm: bool
    multi_latent_attention: bool  # MLA (models/mla.py) with the five sizes below
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int  # MLA: the no-RoPE part of each q/k head
    qk_pos_emb_head_dim: int  # MLA: the decoupled RoPE part
    v_head_dim: int
    add_qkv_bias: bool
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int  # a multiple of make_vocab_size_divisible_by·tp
    seq_length: int
    max_position_embeddings: int
    tie_embeddings: bool
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # YaRN's parameters (models/rope_scaling.py), None: plain RoPE
    init_method_std: float
    hidden_dropout: float
    attention_dropout: float
    sequence_parallel: bool  # in effect (tp > 1)
    attention_backend: str  # resolved: sdpa | flash | te
    linear_backend: str  # local | te
    fp8: str | None
    fp8_recipe: str
    fp8_skip: list[str]
    fp8_unaligned: str
    fp8_all_gather: bool
    num_experts: int | None
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_aux_loss_coeff: float
    moe_z_loss_coeff: float
    moe_capacity_factor: float | None
    moe_layer_freq: int | tuple[int, ...]
    moe_first_k_dense_replace: int
    moe_grouped_gemm: bool
    moe_shared_expert_ffn_hidden_size: int
    moe_shared_expert_overlap: bool
    moe_shared_expert_gate: bool
    moe_router_score_function: str
    moe_router_topk_scaling_factor: float | None
    moe_router_norm_topk: bool | None
    moe_router_enable_expert_bias: bool
    moe_router_bias_update_rate: float
    moe_aux_loss_type: str
    moe_router_num_groups: int | None
    moe_router_group_topk: int | None
    moe_router_group_score: str
    # per layer of the whole model, MoE or dense: the num_layers main layers, then the MTP
    # modules' layers (numbers num_layers .. num_layers + mtp_num_layers - 1)
    moe_layer_pattern: tuple[bool, ...]
    moe_aux_loss_scale: float  # 1 / (microbatches · dp · MoE layers), see moe/layer.py
    recompute_granularity: str | None  # None | selective | full
    recompute_modules: tuple[str, ...]  # selective: core_attn, mlp, moe (else empty)
    recompute_method: str | None  # full: uniform | block
    recompute_num_layers: int  # full: group size (uniform) / recomputed layers (block)
    fp32_residual_connection: bool  # the embedding output (and so the stream) in fp32
    mtp_num_layers: int  # multi-token prediction modules on the loss chunk (models/mtp.py)
    mtp_loss_scaling_factor: float
    # document masking of packed windows (from the data section, resolve.eod_token_id)
    reset_attention_mask: bool = False  # attend within a token's own document only
    reset_position_ids: bool = False  # positions restart at every document start
    eod_token_id: int | None = None  # None unless one of the flags is on

    @property
    def uses_documents(self) -> bool:
        """Whether the chunks need the token ids: per-document attention or positions."""
        return self.reset_attention_mask or self.reset_position_ids

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers `module` (core_attn, mlp, moe)."""
        return module in self.recompute_modules

    @property
    def head_dim(self) -> int:
        """model.kv_channels as resolved: the shipped attention's q/k and v head width (an
        attention part declares its own: `spec.head_dims(config)`)."""
        return self.kv_channels

    @property
    def output_std(self) -> float:
        """Init std of the residual branches' output projections: the entry's `output_std`
        rule, Megatron's scaled init by default."""
        rule = self.spec.output_std or scaled_std
        return rule(self.init_method_std, self.num_layers)

    def is_moe_layer(self, layer_number: int) -> bool:
        return self.moe_layer_pattern[layer_number]

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> TransformerConfig:
        """Resolve the model section of a run config (with the layout's tp and dp)."""
        r = resolve.resolve(cfg, world_size)
        m, p = r.model, r.parallel
        vocab = resolve.vocab_size(r)
        if vocab is None:
            raise ValueError(
                "model.vocab_size is null and no tokenizer names it: build the model with the "
                "data's vocabulary (build_model(..., vocab_size))"
            )
        derived = {
            "spec": get_architecture(m.arch),
            "vocab_size": vocab,
            "padded_vocab_size": resolve.padded_vocab_size(
                vocab, m.make_vocab_size_divisible_by, p.tp
            ),
            "max_position_embeddings": resolve.max_position_embeddings(m),
            "sequence_parallel": resolve.sequence_parallel(p),
            "attention_backend": resolve.attention_backend(m.attention_backend, r.train.precision),
            "linear_backend": resolve.linear_backend(m.linear_backend, m.fp8, m.fp8_recipe),
            "moe_ffn_hidden_size": resolve.moe_ffn_hidden_size(m),
            "moe_layer_freq": tuple(m.moe_layer_freq)
            if isinstance(m.moe_layer_freq, list)
            else m.moe_layer_freq,
            "moe_layer_pattern": tuple(resolve.moe_layer_pattern(m) + resolve.mtp_moe_pattern(m)),
            "kv_channels": resolve.kv_channels(m),
            "moe_aux_loss_scale": resolve.moe_aux_loss_scale(r, p.dp),
            "recompute_modules": resolve.recompute_modules(m),
            "recompute_num_layers": m.recompute_num_layers or 0,
            "reset_attention_mask": r.data.reset_attention_mask,
            "reset_position_ids": r.data.reset_position_ids,
            "eod_token_id": resolve.eod_token_id(r.data),
        }
        # every other ModelConfig field as resolved (a new one must be declared above, or the
        # call below fails on its keyword)
        skip = RUN_ONLY | derived.keys()
        as_set = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name not in skip}
        return cls(**as_set, **derived)
