"""`TransformerConfig`: the frozen, fully resolved description of one model (Megatron's name).

Every field is final: no null placeholders, backends resolved, the vocabulary padded for tp, the
effective sequence parallelism. The transformer layers and model chunks are built from it (and
from the process groups), never from the run `Config`; `from_config` derives it through the
functions of `megatron_lite.resolve`, so it needs no prior `validate()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite import resolve
from megatron_lite.config import Config
from megatron_lite.models.attention import resolve_attention_backend
from megatron_lite.models.gpt import GPT
from megatron_lite.models.llama import LLAMA
from megatron_lite.models.spec import ModelSpec
from megatron_lite.parallel.params import scaled_std
from megatron_lite.parallel.te_linear import resolve_linear_backend

SPECS = {"llama": LLAMA, "gpt": GPT}


@dataclass(frozen=True)
class TransformerConfig:
    spec: ModelSpec  # norm, biases, gated MLP, rotary (models/spec.py)
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int  # a multiple of make_vocab_size_divisible_by·tp
    seq_length: int
    max_position_embeddings: int
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    sequence_parallel: bool = False  # in effect (tp > 1)
    attention_backend: str = "sdpa"  # resolved: sdpa | flash | te
    linear_backend: str = "local"  # local | te
    fp8: str | None = None
    fp8_recipe: str = "tensorwise"
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: float | None = None
    moe_layer_freq: int = 1
    moe_aux_loss_scale: float = 0.0  # 1 / (microbatches · dp · MoE layers), see moe/layer.py
    recompute_granularity: str | None = None  # None | selective | full
    recompute_modules: tuple[str, ...] = ()  # selective: core_attn, mlp, moe (else empty)
    recompute_method: str | None = None  # full: uniform | block
    recompute_num_layers: int = 0  # full: group size (uniform) / recomputed layers (block)
    fp32_residual_connection: bool = False  # the embedding output (and so the stream) in fp32

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers `module` (core_attn, mlp, moe)."""
        return module in self.recompute_modules

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def output_std(self) -> float:
        """Init std of the residual branches' output projections (Megatron's scaled init)."""
        return scaled_std(self.init_method_std, self.num_layers)

    def is_moe_layer(self, layer_number: int) -> bool:
        return resolve.is_moe_layer(self.num_experts, self.moe_layer_freq, layer_number)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> TransformerConfig:
        """Resolve the model section of a run config (with the layout's tp and dp)."""
        r = resolve.resolve(cfg, world_size)
        m, p = r.model, r.parallel
        return cls(
            spec=SPECS[m.arch],
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size,
            vocab_size=m.vocab_size,
            padded_vocab_size=resolve.padded_vocab_size(
                m.vocab_size, m.make_vocab_size_divisible_by, p.tp
            ),
            seq_length=m.seq_length,
            max_position_embeddings=m.max_position_embeddings or m.seq_length,
            tie_embeddings=m.tie_embeddings,
            norm_eps=m.norm_eps,
            rope_theta=m.rope_theta,
            init_method_std=m.init_method_std,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            sequence_parallel=resolve.sequence_parallel(p),
            attention_backend=resolve_attention_backend(m.attention_backend, r.train.precision),
            linear_backend=resolve_linear_backend(m.linear_backend, m.fp8, m.fp8_recipe),
            fp8=m.fp8,
            fp8_recipe=m.fp8_recipe,
            num_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=resolve.moe_ffn_hidden_size(m),
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_z_loss_coeff=m.moe_z_loss_coeff,
            moe_capacity_factor=m.moe_capacity_factor,
            moe_layer_freq=m.moe_layer_freq,
            moe_aux_loss_scale=resolve.moe_aux_loss_scale(r, p.dp),
            recompute_granularity=m.recompute_granularity,
            recompute_modules=resolve.recompute_modules(m),
            recompute_method=m.recompute_method,
            recompute_num_layers=m.recompute_num_layers or 0,
            fp32_residual_connection=m.fp32_residual_connection,
        )
