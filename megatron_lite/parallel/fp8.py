"""FP8 GEMMs for our own linears (model.fp8=tensorwise|rowwise, model.linear_backend=local),
through torchao's float8 training machinery: its recipes' cast configs (`Float8LinearConfig.
from_recipe_name`), amax and scale helpers, and `Float8TrainingTensor`, whose `torch.mm` runs
`torch._scaled_mm`. Our tensor-parallel autograd function (linear_async.py) keeps its own
backward (overlapped collectives, main_grad, deferred wgrad) and calls the three GEMMs here:

    forward  y   = x̂ · Wᵀ     x̂ [T, in], W [out, in]   contraction over in
    dgrad    g_x = g · W      g [T, out]              contraction over out
    wgrad    g_W = gᵀ · x̂                              contraction over T (tokens)

Each operand is cast as the recipe says: tensorwise (one scale; E4M3 for x̂ and W, E5M2 for
g) or rowwise (a scale per row of the contraction, E4M3 everywhere, scales rounded down to a
power of two). The scale is max_fp8 / amax. Under TP a shard's amax is not the whole tensor's:
the scale must be the one a non-sharded run computes, so the amax is max-reduced over TP when
the scale spans the sharded axis (tensorwise: the operand has that axis; rowwise: the sharded
axis is the contraction). Column-parallel layers shard `out`, row-parallel ones `in`.

The optimizer keeps fp32 masters (train.precision=bf16; FP8 under fp32 is refused); the weight
is cast to FP8 as the module stores it. Nothing FP8 is saved for backward: the layer saves
what its bf16 form saves and casts again in backward (the scales are recomputed from the same
values, so they are the forward's), so activation memory is unchanged and each tensorwise
weight costs one more amax and cast (and, under TP, one more amax all-reduce) per backward.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from megatron_lite.parallel import mappings

LOCAL_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearRecipeName values we run
ALIGN = 16  # torch._scaled_mm: every GEMM dimension a multiple of 16


@functools.cache
def _torchao():
    """torchao's float8 modules, imported once. Its import warns, on every rank, that its
    optional C++ kernels (CUTLASS rowwise, MXFP8: none used here; our GEMMs are
    torch._scaled_mm and torchao's Triton casts) do not load, and torch warns of an enum it
    registers: both are silenced for the import only."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import config, float8_training_tensor, float8_utils
    except ImportError as e:
        raise ImportError(
            "model.fp8=tensorwise|rowwise runs through torchao's float8 training: "
            "pip install 'torchao>=0.18' (or the megatron_lite[fp8] extra)"
        ) from e
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return config, float8_training_tensor, float8_utils


@functools.cache
def recipe_config(recipe: str):
    """torchao's Float8LinearConfig for `recipe` (tensorwise | rowwise) and its LinearMMConfig
    (the three GEMMs' fast-accumulation flags, as torchao's Float8Linear builds it)."""
    if recipe not in LOCAL_RECIPES:
        raise ValueError(f"model.fp8={recipe!r}: local FP8 recipes are {LOCAL_RECIPES}")
    config, ftt, _ = _torchao()
    c = config.Float8LinearConfig.from_recipe_name(recipe)
    mm = ftt.LinearMMConfig(
        *(
            ftt.ScaledMMConfig(False, g.use_fast_accum, False, False)
            for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        )
    )
    return c, mm


@dataclass(frozen=True)
class Fp8Gemm:
    """One linear's FP8 setup: the recipe, the TP group, the weight axis sharded over it
    ("out": column-parallel, "in": row-parallel, None: not sharded), and whether ZeRO-3
    gathers its weight in FP8 (model.fp8_all_gather; data_parallel/fsdp_fp8.py)."""

    recipe: str
    group: object = None
    sharded: str | None = None
    all_gather: bool = False

    def _reduce(self, axes: tuple[str, str], contraction: str, axiswise: bool) -> bool:
        if self.sharded is None or mappings.size(self.group) == 1:
            return False
        return contraction == self.sharded if axiswise else self.sharded in axes

    def cast(self, t: torch.Tensor, axes: tuple[str, str], contraction: str, cast, role):
        """t [M, N] (axes name its dims) -> a Float8TrainingTensor scaled per `cast` (a
        torchao CastConfig), or t itself where the recipe keeps it in high precision."""
        config, ftt, utils = _torchao()
        if cast.scaling_type is config.ScalingType.DISABLED:
            return t
        if isinstance(t, ftt.Float8TrainingTensor):  # a weight ZeRO-3 gathered in FP8 (its
            return t  # scale the global one, fsdp_fp8.py; tensorwise: one cast serves both)
        axiswise = cast.scaling_granularity is config.ScalingGranularity.AXISWISE
        dim = (0 if axes.index(contraction) == 0 else -1) if axiswise else None  # amax over it
        amax = utils.tensor_to_amax(t, False, None, cast.scaling_granularity, dim)
        if self._reduce(axes, contraction, axiswise):  # the whole tensor's amax (docstring)
            amax = mappings.all_reduce(
                amax.float().contiguous(), self.group, torch.distributed.ReduceOp.MAX, "fp8_amax"
            )
        c, mm = recipe_config(self.recipe)
        scale = utils.amax_to_scale(amax, cast.target_dtype, c.round_scales_to_power_of_2)
        return ftt.hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, mm, role, dim)

    def forward(self, x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x̂ [T, in] · Wᵀ -> [T, out] in x̂'s dtype."""
        c, _ = recipe_config(self.recipe)
        role = _torchao()[1].GemmInputRole
        a = self.cast(x2d, ("T", "in"), "in", c.cast_config_input, role.INPUT)
        b = self.cast(weight.t(), ("in", "out"), "in", c.cast_config_weight, role.WEIGHT)
        return _mm(a, b, x2d.dtype)

    def dgrad(self, g2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """g [T, out] · W [out, in] -> [T, in] in g's dtype."""
        c, _ = recipe_config(self.recipe)
        role = _torchao()[1].GemmInputRole
        a = self.cast(g2d, ("T", "out"), "out", c.cast_config_grad_output, role.GRAD_OUTPUT)
        w = c.cast_config_weight_for_grad_input
        b = self.cast(weight, ("out", "in"), "out", w, role.WEIGHT)
        return _mm(a, b, g2d.dtype)

    def wgrad(self, g2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        """gᵀ [out, T] · x̂ [T, in] -> [out, in] in g's dtype."""
        c, _ = recipe_config(self.recipe)
        role = _torchao()[1].GemmInputRole
        go = c.cast_config_grad_output_for_grad_weight
        a = self.cast(g2d.t(), ("out", "T"), "T", go, role.GRAD_OUTPUT)
        b = self.cast(x2d, ("T", "in"), "T", c.cast_config_input_for_grad_weight, role.INPUT)
        return _mm(a, b, g2d.dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] · b [K, N], FP8 operands through torch._scaled_mm (torchao's dispatch); a
    high-precision one (a recipe's DISABLED cast) meets the other's dequantized values."""
    ftt = _torchao()[1]
    fp8 = [isinstance(t, ftt.Float8TrainingTensor) for t in (a, b)]
    if all(fp8):
        return torch.mm(a, b).to(dtype)
    a, b = (t.to_original_precision() if f else t for t, f in zip((a, b), fp8, strict=True))
    return torch.mm(a.to(dtype), b.to(dtype))


def gemm_dims_aligned(*dims: int) -> bool:
    """Whether every GEMM dimension is a multiple of 16 (torch._scaled_mm's rule)."""
    return all(d % ALIGN == 0 for d in dims)


UNALIGNED = ("bf16", "error")  # model.fp8_unaligned
