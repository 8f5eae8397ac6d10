"""Muon for the hidden matrices, AdamW for the rest (`train.optimizer=muon`): the update of the
`OptimizerSpec` that muon_spec.py registers (its groups, hyperparameters and checks).

Muon (Keller Jordan 2024; Moonlight, Liu et al. 2025) steps each matrix W with gradient G:

    B <- μ·B + (1-μ)·G                      (momentum, the lerp form torch.optim.Muon uses)
    U <- (1-μ)·G + μ·B   (Nesterov)  or  B
    O <- NS(U)                              (≈ U's orthogonal factor: 5 quintic Newton–Schulz
                                             steps, coefficients (3.4445, -4.7750, 2.0315), on
                                             U/‖U‖_F in bf16 by default)
    W <- W·(1 - lr·wd) - lr·scale(rows, cols)·O

scale ("train.muon_adjust_lr", torch.optim.Muon's adjust_lr_fn): "original" sqrt(max(1,
rows/cols)) (Keller Jordan's), "match_rms_adamw" 0.2·sqrt(max(rows, cols)) (Moonlight's: the
update's RMS matches AdamW's, so Muon shares AdamW's learning rate and weight decay; our
default, since one train.lr serves both optimizers by default).

What Muon steps: the parameter kinds of `hyper["muon_params"]` (muon_spec.param_kind:
attention, mlp, experts, hidden by default; embedding, output and router may be added; norm,
bias and expert_bias are not matrices). AdamW (torch's, with its weight decay on matrices only, as
train.optimizer=adamw) steps every other parameter. A stack of experts [E, rows, cols] is E
matrices, each orthogonalized alone.

Whole matrices. NS needs the whole logical matrix, so the spec's Muon group is not
elementwise: ZeRO-1/2 give each Muon parameter to one owner rank (whole_matrix.py, balanced by
`ns_flops`), ZeRO-3 gathers it to its owner (fsdp_whole_matrix.py); AdamW's groups keep their
flat ZeRO shards. A TP-sharded matrix is gathered over TP on the owner and its TP peers (which
own the same parameter's other shards): the momentum update U is cast to the NS dtype and
all-gathered (kind "muon_tp_gather": (tp-1)/tp of the logical matrix in that dtype received
per rank), every TP rank runs NS on the whole matrix and keeps its own rows (Megatron-Core's
"duplicated" mode: tp× the NS FLOPs, no second collective; a distributed NS would all-reduce
the Gram matrices each iteration instead).

Fused projections (QKV, gate/up; their TP segments, params.ParamMeta.segments, or the expert
stack's `matrix_rows`): with `split_fused` (default) each logical part is orthogonalized and
scaled alone, as a model with separate projections would be (Megatron-Core's default,
split_qkv=True); without it the fused matrix is one matrix, as it is stored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from megatron_lite.parallel import mappings
from megatron_lite.parallel.params import ParamMeta, meta_of

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's, Keller Jordan's
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_dtype", "adjust_lr",
             "split_fused")  # fmt: skip


# ---------------------------------------------------------------- the whole matrices
def segments(meta: ParamMeta, shape: tuple[int, ...]) -> tuple[int, list[int]]:
    """(dim, sizes): the logical matrices fused in one matrix of a parameter whose TP-local
    shape is `shape` (an expert stack's: one expert's), as their sizes along `dim` of the
    whole logical matrix; one size when nothing is fused."""
    if meta.is_expert or len(shape) == 3:
        rows = shape[-2]
        rows_of = list(meta.matrix_rows or ())
        return 0, rows_of if sum(rows_of) == rows else [rows]
    dim = meta.tp_dim if meta.tp_dim is not None else 0
    whole = shape[dim] * tp_size(meta)
    fused = list(meta.segments or ())
    return dim, fused if len(fused) > 1 and sum(fused) == whole else [whole]


def tp_size(meta: ParamMeta) -> int:
    """The TP degree a (non-expert) parameter is sharded over (experts: EP, never gathered)."""
    return meta.tp_size if meta.tp_dim is not None and not meta.is_expert else 1


def matrix_shapes(param: torch.nn.Parameter, split: bool) -> list[tuple[int, int]]:
    """The logical (rows, cols) of every matrix Muon orthogonalizes for `param` (TP-local),
    an expert stack's once per local expert."""
    meta, shape = meta_of(param), tuple(param.shape)
    dim, sizes = segments(meta, shape)
    sizes = sizes if split else [sum(sizes)]
    if len(shape) == 3:
        return [(r, shape[-1]) for _ in range(shape[0]) for r in sizes]
    other = shape[1 - dim] * (tp_size(meta) if meta.tp_dim == 1 - dim else 1)
    return [(s, other) if dim == 0 else (other, s) for s in sizes]


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of `steps` Newton–Schulz iterations on a rows×cols matrix (m = the smaller side,
    n the larger): X·Xᵀ 2m²n, b·A + c·A² 2m³, (a·I + B)·X 2m²n per iteration."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def param_ns_flops(param: torch.nn.Parameter, hyper: Mapping[str, Any]) -> int:
    """The Newton–Schulz FLOPs of one step of `param` (the owner's cost, whole_matrix.py)."""
    split, steps = hyper["split_fused"], hyper["ns_steps"]
    return sum(ns_flops(r, c, steps) for r, c in matrix_shapes(param, split))


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """≈ the orthogonal factor of matrix u (rows×cols), in `dtype` (torch.optim.Muon's
    iteration: on the wide orientation, from u/‖u‖_F)."""
    x = u.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def scale(rows: int, cols: int, rule: str) -> float:
    """The update's scale for a rows×cols matrix (module docstring)."""
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _gather_tp(u: torch.Tensor, dim: int, sizes: list[int], group) -> list[torch.Tensor]:
    """The logical parts (sizes along `dim`) of a matrix of which each TP rank holds 1/tp of
    each part along `dim`, in rank order: [Σ sizes/tp, ·] all-gathered."""
    tp = mappings.size(group)
    flat = u.movedim(dim, 0).contiguous()  # [Σ s/tp, cols]
    blocks = mappings.all_gather_dim0(flat, group, kind="muon_tp_gather").chunk(tp)
    pieces = [b.split([s // tp for s in sizes]) for b in blocks]
    return [torch.cat([p[i] for p in pieces]).movedim(0, dim) for i in range(len(sizes))]


def _logical_scale(shape: tuple[int, ...], meta: ParamMeta, dim: int, rule: str) -> float:
    """The scale of a whole matrix of `shape`, counted without its vocabulary padding (the
    zero rows NS leaves zero; the padding grows with the TP degree, the logical matrix not)."""
    rows, cols = shape
    if meta.padded is not None:
        rows, cols = (meta.full_shape[0], cols) if dim == 0 else (rows, meta.full_shape[1])
    return scale(rows, cols, rule)


def _step_matrix(w, u, meta: ParamMeta, group: dict, tp_group) -> None:
    """w (one matrix, TP-local) -= lr·scale·NS(u) over its logical matrices (module
    docstring): u's TP shards gathered, each fused part alone (split_fused) or together."""
    dtype, steps, rule = NS_DTYPES[group["ns_dtype"]], group["ns_steps"], group["adjust_lr"]
    dim, sizes = segments(meta, tuple(w.shape))
    tp = tp_size(meta) if tp_group is not None else 1
    u = u.to(dtype)  # before the gather: the same values, fewer bytes
    parts = _gather_tp(u, dim, sizes, tp_group) if tp > 1 else list(u.split(sizes, dim))
    rank = mappings.group_rank(tp_group) if tp > 1 else 0
    if group["split_fused"]:
        ratios = [_logical_scale(tuple(x.shape), meta, dim, rule) for x in parts]
        updates = [(newton_schulz(x, steps, dtype), r) for x, r in zip(parts, ratios, strict=True)]
    else:  # the fused matrix as one, in logical order
        whole = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
        o = newton_schulz(whole, steps, dtype)
        ratio = _logical_scale(tuple(whole.shape), meta, dim, rule)
        updates = [(x, ratio) for x in o.split(sizes, dim)]
    for wp, (o, ratio) in zip(w.split([s // tp for s in sizes], dim), updates, strict=True):
        mine = o.narrow(dim, rank * wp.shape[dim], wp.shape[dim])
        wp.add_(mine, alpha=-group["lr"] * ratio)


class Muon(torch.optim.Optimizer):
    """Muon over its groups' tensors (module docstring): whole matrices (TP-local ones are
    gathered over the group dict's "tp_group"), each with its model parameter in the group
    dict's "sources" (its ParamMeta). States: step, momentum_buffer."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            for p, src in zip(group["params"], group["sources"], strict=True):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros(()), momentum_buffer=torch.zeros_like(p))
                state["step"] += 1
                buf, g = state["momentum_buffer"], p.grad
                buf.lerp_(g, 1 - mu)
                u = g.lerp(buf, mu) if group["nesterov"] else buf
                p.mul_(1 - lr * wd)
                meta = meta_of(src)
                if p.dim() == 3:  # a stack of experts: each matrix alone
                    for e in range(p.shape[0]):
                        _step_matrix(p[e], u[e], meta, group, None)
                else:
                    _step_matrix(p, u, meta, group, group["tp_group"])


class Chained:
    """Several torch optimizers as one: their param groups in the order given, one shared
    state dict, each stepped in turn (the wrappers read `state`, `param_groups`, `step`)."""

    def __init__(self, groups: list[dict], parts: list[torch.optim.Optimizer]):
        self.parts, self.param_groups = parts, groups
        self.state = parts[0].state
        for part in parts[1:]:
            self.state.update(part.state)
            part.state = self.state

    def step(self) -> None:
        for part in self.parts:
            part.step()


def make(groups: list[dict], hyper: dict, fused: bool) -> Chained:
    """torch AdamW over the adamw groups (as train.optimizer=adamw: per tensor on CPU, fused
    on CUDA), Muon over the muon group."""
    adamw = [g for g in groups if g["algorithm"] == "adamw"]
    muon = [g for g in groups if g["algorithm"] == "muon"]
    parts = [
        torch.optim.AdamW(adamw, lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                          weight_decay=hyper["weight_decay"], foreach=False, fused=fused or None),
        Muon(muon, {k: hyper[k] for k in MUON_KEYS}),
    ]  # fmt: skip
    return Chained(groups, parts)
