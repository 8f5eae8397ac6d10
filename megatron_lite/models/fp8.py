"""Which layers of a model chunk run FP8 GEMMs (model.fp8=tensorwise|rowwise): every local-GEMM
column/row-parallel linear and MoE expert stack, but those model.fp8_skip names and those whose
dims torch._scaled_mm cannot take (model.fp8_unaligned). The GEMMs themselves: parallel/fp8.py
(linears) and moe/fp8_grouped.py (experts); this module sits above both."""

from __future__ import annotations

import torch

from megatron_lite.parallel.fp8 import ALIGN, UNALIGNED, Fp8Gemm, gemm_dims_aligned, recipe_config


def apply_fp8(
    module: torch.nn.Module, recipe: str, skip, unaligned: str = "bf16", all_gather: bool = False
) -> list[str]:
    """Give every local-GEMM column/row-parallel linear (and MoE experts' grouped GEMMs) in
    `module` FP8 GEMMs of `recipe`, except those whose name contains an entry of `skip`
    (model.fp8_skip) and, with unaligned="bf16", those with a GEMM dim not a multiple of 16
    (with "error" those raise). `all_gather` (model.fp8_all_gather) marks the linears whose
    weights ZeRO-3 gathers in FP8 (tensorwise only: data_parallel/fsdp_fp8.py). Returns the
    names of the layers now in FP8."""
    import torch.nn.functional as F

    from megatron_lite.moe.experts import LocalExperts
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear

    if unaligned not in UNALIGNED:
        raise ValueError(f"model.fp8_unaligned={unaligned!r}: expected one of {UNALIGNED}")
    recipe_config(recipe)  # torchao present, the recipe known: fail at build, not at step 1
    done = []
    for name, m in module.named_modules():
        kinds = (ColumnParallelLinear, RowParallelLinear, LocalExperts)
        if not isinstance(m, kinds) or any(s in name for s in skip):
            continue
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            if m._gemm is not F.linear:  # Transformer Engine's GEMM, its own FP8
                continue
            if m.weight is None:  # the tied output layer: the embedding's weight
                raise ValueError(
                    f"model.fp8_skip={list(skip)!r}: the tied output layer {name!r} borrows the "
                    "embedding's weight and stays bf16. Fix: keep 'output_layer' in model.fp8_skip"
                )
            dims = tuple(m.weight.shape)  # [out/tp, in] or [out, in/tp]
            sharded = "out" if isinstance(m, ColumnParallelLinear) else "in"
            spec = Fp8Gemm(recipe, m.tp_group, sharded, all_gather and recipe == "tensorwise")
        else:  # the experts: [E_local, out, in] stacks
            dims = tuple(m.weight1.shape[1:]) + tuple(m.weight2.shape[1:])
            spec = Fp8Gemm(recipe)
        if not gemm_dims_aligned(*dims):
            if unaligned == "error":
                raise ValueError(
                    f"model.fp8_unaligned=error: layer {name!r} has GEMM dims {dims}, not all "
                    f"multiples of {ALIGN} (torch._scaled_mm's rule). Fix: set "
                    f"model.fp8_unaligned=bf16 to keep it in bf16, add {name!r} to "
                    "model.fp8_skip, or change the model's sizes"
                )
            continue
        m.fp8 = spec
        done.append(name)
    return done
