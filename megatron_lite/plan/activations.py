"""Activation bytes saved for backward, per transformer layer and per pipeline stage, per
microbatch on one rank, as unique storages (the SavedTensorMeter's unit): measured on the real
layer at the layout's local shapes (plan/saved.py), then composed by the recompute mode:

- none: every row the layer saves (module path -> bytes, `layer_saves`);
- selective (model.recompute_modules: core_attn, mlp, moe; Megatron's names): the layer measured
  with those modules recomputed (their internals dropped, their inputs kept; ring attention is
  never recomputed, models/transformer.py);
- full: each recomputed group keeps its input [s/cp(/tp), b, h] in the residual stream's dtype
  and rebuilds the rest of its layers' activations during its backward.

The embedding, final norm, output layer and loss terms are `head_terms` (the final norm
and the multi-token prediction modules measured); what exists only for a moment (working
sets) is plan/working.py's; the moment of a rank's peak, and every term then,
plan/peak.py's. The published formulas (Korthikanti et al. 2022 Table 2, Megatron-LM's
theoretical memory) and the former per-term formulas are tests/plan_reference.py's:
independent checks of the measured figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.plan import modules
from megatron_lite.plan.saved import MLP, final_norm_saves, layer_saves, mtp_saves, subtree
from megatron_lite.resolve import (
    cp_a2a_size,
    moe_ffn_hidden_size,
    num_query_groups,
    padded_vocab_size,
    recompute_modules,
    resolve,
    sequence_parallel,
)
from megatron_lite.validation.recompute import RECOMPUTE_MODULES

SELECTIVE_MODULES = RECOMPUTE_MODULES  # what the model can recompute (validation's list)


@dataclass(frozen=True)
class LayerShape:
    """The layout's sizes the working sets and step time read (local sizes derive from
    these); what a layer saves is measured (layer_saves)."""

    s: int  # sequence length (full)
    b: int  # micro batch
    h: int
    n: int  # attention heads
    g: int  # KV groups
    f: int  # MLP width
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ring: int = 1  # ring-attention ranks of the cp (p2p: cp; a2a: 1), Ulysses over cp/ring
    act_bytes: int = 2
    residual_bytes: int = 4
    dropout: bool = False  # hidden_dropout > 0
    kernels: str = "fused"  # fused (Triton, GPU) | torch (plain-torch references, CPU)
    experts: int = 0  # experts per MoE layer (0: dense model)
    topk: int = 0  # experts per token
    moe_f: int = 0  # an expert's MLP width
    ep: int = 1
    gated: bool = True  # the MLP's fc1 has [gate, up] segments (the model's spec)
    main_grad: bool = True  # ZeRO 0-2: weight gradients go into the buffer's main_grad
    shared_f: int = 0  # the MoE layer's shared expert width (0: none)
    grouped_gemm: bool = True  # the local experts as one grouped GEMM (False: a loop)
    head_dim: int = 0  # each q/k head's width, the attention part's (0: h / n)
    v_head_dim: int = 0  # each v head's width (0: = the q/k width; MLA's differs)

    @property
    def tokens(self) -> float:
        return self.s / self.cp * self.b

    @property
    def a2a(self) -> int:
        """Ranks of one Ulysses all-to-all (1: none)."""
        return self.cp // self.ring

    @property
    def d(self) -> int:
        """The q/k head dimension."""
        return self.head_dim or self.h // self.n

    @property
    def dv(self) -> int:
        """The v head dimension."""
        return self.v_head_dim or self.d

    @property
    def u(self) -> float:
        return 1 / self.tp if self.sp else 1.0


def moe_assignments(x: LayerShape) -> float:
    """(token, expert) rows one rank sends and receives per MoE layer and microbatch: its
    T·u tokens times top-k (a dry run's balanced, dropless routing)."""
    return x.tokens * x.u * x.topk


def layer_input_bytes(x: LayerShape) -> float:
    """A layer's input (the residual stream), what full recompute keeps."""
    return x.tokens * x.h * x.u * x.residual_bytes


# ----------------------------------------------------------------------------- from a config
def recompute_settings(cfg: Config) -> tuple[str | None, list[str], str, int]:
    """(granularity, modules, method, num_layers) from model.recompute_* (Megatron's names)."""
    m = cfg.model
    modules = recompute_modules(m)  # () unless selective
    method = m.recompute_method or "uniform"  # unvalidated configs (the search) may leave it
    return m.recompute_granularity, list(modules), method, int(m.recompute_num_layers or 1)


def residual_bytes(cfg: Config) -> int:
    """The residual stream's bytes: fp32 unless bf16 training without fp32_residual_connection."""
    if cfg.train.precision != "bf16":
        return 4
    return 4 if cfg.model.fp32_residual_connection else 2


def resolved(cfg: Config, world: int) -> Config:
    """`cfg` itself when its derived fields are filled in (validate()'s output), else resolve."""
    m = cfg.model
    done = cfg.parallel.dp is not None and m.ffn_hidden_size and m.num_query_groups
    return cfg if done else resolve(cfg, world)


def head_dims(cfg: Config):
    """The attention part's `HeadDims` (q/k, v, rotary widths) of the resolved `cfg`."""
    return modules.head_dims(cfg)


def layer_shape(cfg: Config, kernels: str = "fused") -> LayerShape:
    p = cfg.parallel
    r = resolved(cfg, p.tp * p.pp * p.cp * (p.dp or 1))
    m, gated = r.model, modules.layer_params(r, False).gated
    dims = head_dims(r)
    return LayerShape(
        s=m.seq_length, b=cfg.train.micro_batch_size, h=m.hidden_size,
        n=m.num_attention_heads, g=num_query_groups(m), f=m.ffn_hidden_size, tp=p.tp,
        sp=sequence_parallel(p), cp=p.cp, ring=p.cp // cp_a2a_size(p),
        act_bytes=2 if cfg.train.precision == "bf16" else 4,
        residual_bytes=residual_bytes(cfg), dropout=m.hidden_dropout > 0, kernels=kernels,
        experts=m.num_experts or 0, topk=m.moe_router_topk if m.num_experts else 0,
        moe_f=moe_ffn_hidden_size(m) if m.num_experts else 0, ep=p.ep, gated=gated,
        main_grad=p.zero_stage < 3, head_dim=dims.qk, v_head_dim=dims.v,
        shared_f=m.moe_shared_expert_ffn_hidden_size if m.num_experts else 0,
        grouped_gemm=m.moe_grouped_gemm,
    )  # fmt: skip


def deferred_wgrad_bytes(cfg: Config, shape: LayerShape, moe: bool = False) -> float:
    """Bytes one layer's queued weight-gradient GEMMs keep from its B to its W (zero-bubble
    schedules: linear_async.defer_wgrad), one microbatch: each queueable parallel linear's
    (plan/modules.py) input as the GEMM reads it and its output gradient, T tokens of its
    weight's in and out widths (the column-parallel ones' input all-gathered under SP, the
    row-parallel ones' output gradient before its reduce-scatter), in the compute dtype. An
    MoE layer's experts and router run their weight gradients in B."""
    widths = sum(o + i for o, i in modules.layer_params(cfg, moe).linear_shapes)
    return shape.tokens * shape.act_bytes * widths


def _selective_modules(cfg: Config, shape: LayerShape) -> tuple[str, ...]:
    gran, mods, _, _ = recompute_settings(cfg)
    if gran != "selective":
        return ()
    unknown = [m for m in mods if m not in SELECTIVE_MODULES]
    if unknown:
        raise ValueError(
            f"model.recompute_modules: {unknown} not modelled; the planner knows "
            f"{', '.join(SELECTIVE_MODULES)}"
        )
    if shape.ring > 1:  # ring attention is never recomputed (models/transformer.py)
        mods = [m for m in mods if m != "core_attn"]
    return tuple(mods)


def layer_rows(cfg: Config, shape: LayerShape, moe: bool = False) -> dict[str, float]:
    """{module path: bytes} one layer saves without recompute (measured)."""
    return layer_saves(cfg, moe, shape.kernels)


def layer_bytes(cfg: Config, shape: LayerShape, moe: bool = False) -> dict[str, float]:
    """Per-layer rows under the config's recompute mode (module path -> bytes), and 'full'
    recompute's input."""
    gran = recompute_settings(cfg)[0]
    if gran == "full":
        return {"input": layer_input_bytes(shape)}
    return layer_saves(cfg, moe, shape.kernels, _selective_modules(cfg, shape))


def rebuilt_mlp(cfg: Config, shape: LayerShape, moe: bool) -> float:
    """What selective recompute of the layer's MLP (or MoE) rebuilds in its backward: the
    module's saves but its input, which the recompute keeps."""
    return (
        subtree(layer_rows(cfg, shape, moe), MLP)
        - shape.tokens * shape.u * shape.h * shape.act_bytes
    )


def chunk_bytes(cfg: Config, shape: LayerShape, moe: list[bool]) -> tuple[float, float]:
    """(bytes kept per microbatch by the layers of one model chunk, `moe[i]` whether its i-th
    layer is an MoE layer; under full recompute the activations one recomputed group rebuilds
    during its backward, all of its layers' but the kept input, else 0)."""
    gran, _, method, num = recompute_settings(cfg)
    kinds = set(moe)
    if gran != "full":
        kept = {e: sum(layer_bytes(cfg, shape, e).values()) for e in kinds}
        return sum(kept[e] for e in moe), 0.0
    whole = {e: sum(layer_rows(cfg, shape, e).values()) for e in kinds}
    full = [whole[e] for e in moe]
    inp = layer_input_bytes(shape)
    if method == "block":
        k = min(num, len(moe))
        return k * inp + sum(full[k:]), max(full[:k], default=inp) - inp
    groups = [sum(full[i : i + num]) for i in range(0, len(moe), num)]
    return len(groups) * inp, max(groups, default=inp) - inp  # (the group's input is kept)


def head_terms(cfg: Config, shape: LayerShape) -> dict[str, float]:
    """Embedding (first stage) and final norm (measured), output layer input, logits and loss,
    and the MTP modules' saves (measured; last stage), per microbatch: {term: bytes}. Logits
    are saved as fp32 vocab-parallel chunks [T, V/tp]."""
    m = cfg.model
    T, u, A, t = shape.tokens, shape.u, shape.act_bytes, shape.tp
    v_local = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t) / t
    lin_in = T * shape.h * A / (t if shape.sp else 1)
    return {
        # int64 ids and a bool mask per token (+ the dropout mask)
        "embedding": 9 * T + (T * shape.h * u if shape.dropout else 0.0),
        "final_norm": final_norm_saves(cfg, shape.kernels),
        "output_in": lin_in,
        "logits": 4 * T * v_local + 12 * T,  # fp32 logits, lse (4) and int64 targets (8)
        # the loss backward's fp32 gradient beside the saved logits (torch: exp, then × dloss)
        "logits_grad": (8 if shape.kernels == "torch" else 4) * T * v_local,
        "embedding_grad": v_local * shape.h * A,  # its dense weight gradient, in backward
        # the multi-token prediction modules' saves (measured; the loss chunk, 0 without MTP)
        "mtp": mtp_saves(cfg, shape.kernels),
    }
