"""Tensor-parallel layers on plain tensors: ColumnParallelLinear, RowParallelLinear and
VocabParallelEmbedding, with optional sequence parallelism (activations [s/tp, b, h] outside
the tensor-parallel region)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.parallel import mappings
from megatron_lite.parallel.fp8 import Fp8Gemm
from megatron_lite.parallel.linear_async import parallel_linear
from megatron_lite.parallel.params import set_meta


def _tp(group) -> tuple[int, int]:
    return (mappings.size(group), torch.distributed.get_rank(group) if group is not None else 0)


class _GemmMode:
    """train()/eval() also reach a Transformer Engine GEMM, which sits outside the module tree."""

    def train(self, mode: bool = True):
        super().train(mode)
        if hasattr(self._gemm, "train"):
            self._gemm.train(mode)
        return self


def _gemm_and_weight(backend: str, out_features: int, in_features: int, skip_weight=False):
    """The local GEMM y = x Wᵀ (+ b) and the weight [out, in] it computes with: torch's F.linear
    and a new Parameter, or a Transformer Engine Linear (FP8 capable) and the weight Parameter
    TE created for itself, which the layer owns (see parallel/te_linear.py). No weight (a
    borrowed one) computes with F.linear."""
    if backend not in ("local", "te"):
        raise ValueError(f"unknown linear backend {backend!r} (local | te)")
    if skip_weight:
        return F.linear, None
    if backend == "local":
        return F.linear, nn.Parameter(torch.empty(out_features, in_features))
    from megatron_lite.parallel.te_linear import TELinearGemm

    gemm = TELinearGemm(out_features, in_features)
    return gemm, gemm.weight


class ColumnParallelLinear(_GemmMode, nn.Module):
    """Y = X Aᵀ + b with A split along its output dim: [s(/tp), b, in] -> [s, b, out/tp].

    `out_features` may be a list of segments (e.g. [q, k, v] or [gate, up]); each segment is
    split across TP separately, so rank r holds its slice of every segment. With
    `sequence_parallel`, the input is the sequence shard and is all-gathered first (backward:
    reduce-scatter); otherwise the input is replicated and its gradient is all-reduced.
    `gemm` picks the local matrix multiply: "local" (torch) or "te" (Transformer Engine).

    With "local" the layer runs linear_async.parallel_linear: with SP only the input shard is
    saved for backward, the backward collectives overlap the GEMMs (`overlap_tp_comm`), the
    weight gradient goes into `main_grad` when there is one, and with `wgrad_queue` set (see
    linear_async.defer_wgrad) the wgrad GEMMs are queued instead of run.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        tp_group,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        init_std: float = 0.02,
        skip_weight: bool = False,
        gemm: str = "local",
        overlap_tp_comm: bool = True,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.gather_output = (
            tp_group,
            sequence_parallel,
            gather_output,
        )
        self.overlap_tp_comm = overlap_tp_comm
        self.wgrad_queue: list | None = None
        self.fp8: Fp8Gemm | None = None  # FP8 GEMMs (models/fp8.py: apply_fp8 sets it)
        tp, rank = _tp(tp_group)
        segments = list(out_features) if isinstance(out_features, list | tuple) else [out_features]
        for seg in segments:
            if seg % tp:
                raise ValueError(f"output segment {seg} not divisible by tp={tp}")
        out_local, out_full = sum(segments) // tp, sum(segments)
        shard = dict(tp_dim=0, tp_rank=rank, tp_size=tp, segments=tuple(segments))
        # the tied output layer borrows the embedding's weight (skip_weight)
        self._gemm, self.weight = _gemm_and_weight(gemm, out_local, in_features, skip_weight)
        if self.weight is not None:
            set_meta(self.weight, full_shape=(out_full, in_features), std=init_std, **shard)
        self.bias = None
        if bias:
            self.bias = set_meta(
                nn.Parameter(torch.empty(out_local)), full_shape=(out_full,), init="zeros", **shard
            )

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self._gemm is F.linear:
            comm = "gather" if self.sequence_parallel else "all_reduce"
            y = parallel_linear(
                x,  # [s/tp, b, h] with SP, else [s, b, h]
                self.weight if weight is None else weight,
                self.bias,
                self.tp_group,
                input_comm=comm,
                overlap=self.overlap_tp_comm,
                wgrad_queue=self.wgrad_queue,
                # a borrowed (tied) weight also gets the embedding's gradient in this backward:
                # both are summed in .grad first, as under FSDP2 (the same bf16 arithmetic)
                accumulate_main_grad=weight is None,
                fp8=self.fp8,
            )  # [s, b, out/tp]
        else:
            y = self._te_forward(x, self.weight if weight is None else weight)
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.tp_group)
        return y

    def _te_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)  # [s/tp]->[s]
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.tp_group)
        return self._gemm(x, weight, self.bias)  # [s, b, out/tp]


class RowParallelLinear(_GemmMode, nn.Module):
    """Y = X Aᵀ + b with A split along its input dim: [s, b, in/tp] -> [s(/tp), b, out].

    The partial products are all-reduced, or reduce-scattered along the sequence with
    `sequence_parallel`. The bias is replicated and added after the reduction (its gradient is
    summed over TP when it sees only a sequence shard). `gemm` and `wgrad_queue` as in
    ColumnParallelLinear (its collective follows the GEMM: nothing to overlap inside it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        gemm: str = "local",
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.wgrad_queue: list | None = None
        self.fp8: Fp8Gemm | None = None  # as in ColumnParallelLinear
        tp, rank = _tp(tp_group)
        if in_features % tp:
            raise ValueError(f"input size {in_features} not divisible by tp={tp}")
        self._gemm, self.weight = _gemm_and_weight(gemm, out_features, in_features // tp)
        set_meta(
            self.weight,
            full_shape=(out_features, in_features),
            tp_dim=1,
            tp_rank=rank,
            tp_size=tp,
            std=init_std,
        )
        self.bias = None
        if bias:
            self.bias = set_meta(
                nn.Parameter(torch.empty(out_features)),
                full_shape=(out_features,),
                init="zeros",
                sequence_parallel=sequence_parallel and tp > 1,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemm is F.linear:  # main_grad accumulation and deferred wgrad; no input comm
            y = parallel_linear(
                x,
                self.weight,
                None,
                self.tp_group,
                input_comm="none",
                wgrad_queue=self.wgrad_queue,
                fp8=self.fp8,
            )
        else:
            y = self._gemm(x, self.weight)  # [s, b, out] partial sums over TP
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)  # [s/tp]
        else:
            y = mappings.reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token ids [s, b] -> [s, b, h] partial sums (rows owned by this rank, zeros elsewhere).

    The vocabulary is padded to `padded_vocab_size` (zeros, never looked up) and split evenly
    across TP. The caller reduces the partial sums (all-reduce, or reduce-scatter into
    sequence shards), so it can add replicated terms after the reduction.
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        hidden_size: int,
        tp_group,
        *,
        init_std: float = 0.02,
    ):
        super().__init__()
        tp, rank = _tp(tp_group)
        self.tp_group = tp_group
        self.per_rank = padded_vocab_size // tp
        self.vocab_start = rank * self.per_rank
        self.weight = set_meta(
            nn.Parameter(torch.empty(self.per_rank, hidden_size)),
            full_shape=(vocab_size, hidden_size),
            tp_dim=0,
            tp_rank=rank,
            tp_size=tp,
            padded=padded_vocab_size,
            std=init_std,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(ids, self.weight, self.vocab_start // self.per_rank)


def vocab_parallel_lookup(ids: torch.Tensor, weight: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """ids [...] -> [..., h] partial sums: the rows of `weight` (rank `tp_rank`'s [V/tp, h]
    shard of a vocab-parallel embedding) for the ids it owns, zeros for the others."""
    per_rank = weight.shape[0]
    local = ids - tp_rank * per_rank
    outside = (local < 0) | (local >= per_rank)
    out = F.embedding(local.masked_fill(outside, 0), weight)  # [..., h]
    return out.masked_fill(outside.unsqueeze(-1), 0.0)
