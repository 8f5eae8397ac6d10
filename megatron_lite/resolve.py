"""The resolve step: every field derived from a run config, computed in one place.

`validate()` only checks; `resolve(cfg, world_size)` returns a copy of the config with the
derived fields the user may leave null filled in (parallel.dp, model.num_query_groups,
model.ffn_hidden_size). The small functions below are the one owner of each derivation: the
validators, the planner, the per-model `TransformerConfig` and the trainer import them. That
includes the vocabulary before any data is read (`vocab_size`) and the attention and linear
backends (`attention_backend`, `linear_backend`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os

from megatron_lite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig


def data_parallel_size(p: ParallelConfig, world_size: int) -> int:
    """parallel.dp, or world / (tp·pp·cp) when it is null."""
    return p.dp if p.dp is not None else world_size // (p.tp * p.pp * p.cp)


CP_COMM_TYPES = ("a2a", "p2p", "a2a+p2p")


def cp_a2a_size(p: ParallelConfig) -> int:
    """Ranks of each CP group in one Ulysses all-to-all: all of cp for a2a, 1 for p2p (the ring
    alone), parallel.cp_a2a_size for a2a+p2p; the ring spans cp / that."""
    if p.cp_comm_type == "p2p":
        return 1
    if p.cp_comm_type == "a2a+p2p":
        return p.cp_a2a_size
    return p.cp


def rank_layout(p: ParallelConfig, world_size: int):
    """The rank grid of `p` on `world_size` ranks (parallel.mesh.RankLayout)."""
    from megatron_lite.parallel.mesh import RankLayout

    return RankLayout(
        world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, order=p.order, cp_a2a=cp_a2a_size(p)
    )


def num_query_groups(m: ModelConfig) -> int:
    """KV heads: model.num_query_groups, or one per attention head when null."""
    return m.num_query_groups if m.num_query_groups is not None else m.num_attention_heads


def ffn_hidden_size(m: ModelConfig) -> int:
    """The dense MLP width: model.ffn_hidden_size, or the architecture's default when null
    (its registry entry's: 8h/3 rounded up to a multiple of 64 for llama, 4h for gpt)."""
    if m.ffn_hidden_size is not None:
        return m.ffn_hidden_size
    from megatron_lite.models.registry import get_architecture  # light: no layers loaded

    return get_architecture(m.arch).ffn_hidden_size(m.hidden_size)


def moe_ffn_hidden_size(m: ModelConfig) -> int:
    return m.moe_ffn_hidden_size or ffn_hidden_size(m)


def stage_layers(m: ModelConfig, p: ParallelConfig) -> list[int]:
    """Layers of each of the pp·vpp virtual stages: parallel.pipeline_layers, or Megatron's
    decoder_first/last_pipeline_num_layers with the rest split evenly, or an even split."""
    stages = p.pp * p.vpp
    if p.pipeline_layers is not None:
        return list(p.pipeline_layers)
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return [m.num_layers // stages] * stages
    ends = [n for n in (first, last) if n is not None]
    middle = stages - len(ends)
    rest = (m.num_layers - sum(ends)) // middle if middle else 0
    counts = [rest] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def split_weights(split: str) -> list[float] | None:
    """data.split "969,30,1" -> [train, valid, test] weights normalized to 1 (missing parts 0);
    None when it is not 1 to 3 finite non-negative numbers with a positive sum."""
    try:
        values = [float(x) for x in split.split(",")]
    except ValueError:
        return None
    if not 1 <= len(values) <= 3 or any(not 0 <= v < float("inf") for v in values):
        return None
    total = sum(values)
    return None if total <= 0 else [v / total for v in values + [0.0] * (3 - len(values))]


def num_microbatches(t: TrainConfig, dp: int) -> int:
    """Microbatches per step on each data-parallel rank."""
    return t.global_batch_size // (t.micro_batch_size * dp)


def sequence_parallel(p: ParallelConfig) -> bool:
    """Sequence parallelism is in effect only with tp > 1."""
    return p.sequence_parallel and p.tp > 1


def tokenizer_vocab_size(d: DataConfig) -> int | None:
    """The tokens of the tokenizer the data section names, read before any data is: a built-in
    corpus's tokenizer is trained to data.tokenizer_vocab_size on its first run; a given
    data.tokenizer_model file is opened. None without a tokenizer (mock data, data.paths alone)
    or while the file does not exist (validation reports that)."""
    if d.mock:
        return None  # mock tokens come from model.vocab_size (build_dataset ignores tokenizers)
    if d.corpus is not None:
        return d.tokenizer_vocab_size
    path = d.tokenizer_model
    if path is None or not (os.path.isfile(path) and os.access(path, os.R_OK)):
        return None
    from megatron_lite.data.tokenizer import Tokenizer  # sentencepiece / tokenizers: only here

    return Tokenizer(path).vocab_size


def eod_token_id(d: DataConfig) -> int | None:
    """The end-of-document id of document masking: data.eod_token_id, else the tokenizer's eos
    (a built-in corpus's trained tokenizer, or data.tokenizer_model once it exists). None when
    no data.reset_*/eod_mask_loss flag is on, or without one (mock data, data.paths alone:
    validation requires data.eod_token_id then)."""
    if not uses_documents(d):
        return None
    if d.eod_token_id is not None:
        return d.eod_token_id
    if d.mock:
        return None
    if d.corpus is not None:
        from megatron_lite.data.tokenizer import TRAINED_EOS_ID  # the corpus tokenizer's

        return TRAINED_EOS_ID
    path = d.tokenizer_model
    if path is None or not (os.path.isfile(path) and os.access(path, os.R_OK)):
        return None
    from megatron_lite.data.tokenizer import Tokenizer

    return Tokenizer(path).eos_id


def uses_documents(d: DataConfig) -> bool:
    """Whether any document-masking flag (attention, positions, loss) is on."""
    return d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss


def eod_mask_id(d: DataConfig) -> int | None:
    """The input id whose loss data.eod_mask_loss excludes (`split_sample`), else None."""
    return eod_token_id(d) if d.eod_mask_loss else None


def vocab_size(cfg: Config) -> int | None:
    """The model's vocabulary: model.vocab_size when set, else the tokenizer's
    (`tokenizer_vocab_size`). None when only the data can tell (data.paths without a tokenizer:
    its largest token id + 1, which build_dataset reads)."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    return tokenizer_vocab_size(cfg.data)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of divisible_by·tp (padding never changes the loss)."""
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


def moe_layer_pattern(m: ModelConfig) -> list[bool]:
    """Which layers are MoE: `moe_layer_freq` as every k-th layer from layer 0 or a 0/1 list
    per layer, then the first `moe_first_k_dense_replace` layers dense. All False when dense."""
    return list(_pattern_of(m))


def _pattern_of(m: ModelConfig) -> tuple[bool, ...]:
    """moe_layer_pattern as the cached tuple (no per-call copy: is_moe_layer is asked per
    layer, and a copy per call made that quadratic in the layer count)."""
    freq = tuple(m.moe_layer_freq) if isinstance(m.moe_layer_freq, list) else m.moe_layer_freq
    return _pattern(m.num_experts is None, freq, m.moe_first_k_dense_replace, m.num_layers)


@functools.lru_cache(maxsize=256)
def _pattern(dense: bool, freq, first_dense: int, layers: int) -> tuple[bool, ...]:
    if dense:
        return (False,) * layers
    if isinstance(freq, tuple):
        pattern = [bool(v) for v in freq]
    else:
        pattern = [i % freq == 0 for i in range(layers)]
    return tuple(moe and i >= first_dense for i, moe in enumerate(pattern))


def is_moe_layer(m: ModelConfig, layer_number: int) -> bool:
    """Whether layer `layer_number` (0-based, over the whole model) is an MoE layer."""
    return _pattern_of(m)[layer_number]


def num_moe_layers(m: ModelConfig) -> int:
    return sum(_pattern_of(m))


def mtp_moe_pattern(m: ModelConfig) -> list[bool]:
    """Which MTP modules' layers are MoE (models/mtp.py): each is of the kind of the main
    model's last layer (Megatron builds its MTP layer from the decoder's last layer spec)."""
    last = bool(_pattern_of(m)[-1]) if m.num_layers > 0 else False
    return [last] * m.mtp_num_layers


def embedding_copy(m: ModelConfig) -> bool:
    """Whether the last pipeline stage holds a copy of the input embedding (summed over the
    embedding group when pp > 1): the tied output layer's, or the MTP modules' lookup."""
    return m.tie_embeddings or m.mtp_num_layers > 0


def kv_channels(m: ModelConfig) -> int:
    """The head dimension: model.kv_channels, or hidden_size / num_attention_heads."""
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def moe_aux_loss_scale(cfg: Config, dp: int) -> float:
    """Gradient of each microbatch's aux term: 1 / (microbatches · dp · MoE layers, the MTP
    modules' included), a constant of the config, so the trained objective is the same on
    every layout (see moe/layer.py)."""
    n_layers = num_moe_layers(cfg.model) + sum(mtp_moe_pattern(cfg.model))
    if n_layers == 0:
        return 0.0
    return 1.0 / (num_microbatches(cfg.train, dp) * dp * n_layers)


def recompute_modules(m: ModelConfig) -> tuple[str, ...]:
    """The modules selective recompute covers: model.recompute_modules under
    recompute_granularity=selective, none otherwise (full recomputes whole layers)."""
    return tuple(m.recompute_modules) if m.recompute_granularity == "selective" else ()


def max_position_embeddings(m: ModelConfig) -> int:
    """Learned positions (gpt): model.max_position_embeddings, or seq_length when null."""
    return m.max_position_embeddings or m.seq_length


def attention_backend(requested: str, precision: str) -> str:
    """model.attention_backend auto|sdpa|flash|te -> the backend that runs; raises
    ValueError(message) when the requested one cannot run here. `auto` picks flash-attn only
    where it computes the same math up to dtype rounding (CUDA, bf16 training), else SDPA."""
    from megatron_lite import optional  # imports torch: not for config-only tools

    if requested == "auto":
        # flash-attn has no fp32 kernels: in fp32 training it would change the math
        flash = optional._cuda() and precision == "bf16" and optional._installed("flash_attn")
        return "flash" if flash else "sdpa"
    if requested in optional.INSTALL:
        optional.require_cuda_package(
            "model.attention_backend", requested, "model.attention_backend=sdpa (or auto)"
        )
        if requested == "flash" and precision != "bf16":
            raise ValueError(
                "model.attention_backend='flash' computes in bf16/fp16 only. Fix: "
                "set train.precision=bf16, or use sdpa"
            )
    return requested


def linear_backend(requested: str, fp8: str | None, recipe: str = "tensorwise") -> str:
    """model.linear_backend local|te -> the backend; raises ValueError(message) when
    Transformer Engine, or its FP8 recipe `recipe` (with model.fp8 set), cannot run here."""
    if requested == "local":
        return requested
    from megatron_lite import optional
    from megatron_lite.parallel import te_linear  # TE's own verdict on the recipe and GPU

    optional.require_cuda_package("model.linear_backend", requested, "model.linear_backend=local")
    if fp8 is not None:
        ok, reason = te_linear.fp8_support(recipe)
        if not ok:
            raise ValueError(
                f"model.fp8_recipe={recipe!r}: Transformer Engine says it cannot run here "
                f"({reason}). Fix: pick another model.fp8_recipe (tensorwise and delayed need "
                "Hopper or Ada; blockwise Hopper and CUDA >= 12.9; mxfp8 Blackwell), upgrade "
                "transformer-engine, or set model.fp8=null for bf16 GEMMs through TE"
            )
    return requested


def _copy(cfg: Config) -> Config:
    """A copy of `cfg` sharing nothing mutable: each section copied, its lists too (every
    field is a scalar or a flat list of scalars; copy.deepcopy was the planner's search's
    largest cost)."""
    sections = {}
    for f in dataclasses.fields(cfg):
        section = copy.copy(getattr(cfg, f.name))
        for name, value in vars(section).items():
            if isinstance(value, list):
                setattr(section, name, list(value))
        sections[f.name] = section
    return dataclasses.replace(cfg, **sections)


def resolve(cfg: Config, world_size: int) -> Config:
    """A copy of `cfg` with every null derived field filled in; `cfg` is left as it is."""
    out = _copy(cfg)
    out.parallel.dp = data_parallel_size(cfg.parallel, world_size)
    out.model.num_query_groups = num_query_groups(cfg.model)
    out.model.ffn_hidden_size = ffn_hidden_size(cfg.model)
    return out
