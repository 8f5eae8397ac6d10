"""FP8 grouped GEMM for the local experts (model.fp8 set, experts not in model.fp8_skip).

torchao's float8 MoE training has one recipe for grouped GEMMs: E4M3 everywhere, dynamic
rowwise scales rounded down to a power of two (torchao.prototype.moe_training.fp8_grouped_mm).
Scales run along each GEMM's contraction:

    forward  y   = x · W_e        x per row (over h), W_e per (expert, column) (over h)
    dgrad    g_x = g · W_eᵀ       g per row (over out), W_e per (expert, row) (over out)
    wgrad    g_W = x_eᵀ · g_e     x and g per (expert group, column) (over the group's tokens)

On a GPU this runs torchao's `_to_fp8_rowwise_then_scaled_grouped_mm` (torch._scaled_grouped_mm,
Triton casts); `torch._scaled_grouped_mm` has no CPU kernel, so elsewhere the same casts are
applied and the FP8 values, dequantized to fp32 (exact: 4 significant bits times a power of two),
meet in an fp32 grouped GEMM: the FP8 numerics, not its speed. Both recipes of model.fp8 use
this one for the experts (torchao has no tensorwise grouped recipe).
"""

from __future__ import annotations

import torch

from megatron_lite.parallel.fp8 import _torchao

E4M3 = torch.float8_e4m3fn


def _qdq(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t scaled to E4M3 by its amax over `dim` (power-of-two scale), back in fp32."""
    _, _, utils = _torchao()
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = utils.amax_to_scale(amax, E4M3, round_scales_to_power_of_2=True)
    return utils.to_fp8_saturated(t.float() * scale, E4M3).float() / scale


def _qdq_groups(t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """t [N, c] with row groups ending at `offsets`: each group scaled per column."""
    ends = offsets.tolist()
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    return torch.cat([_qdq(block, 0) if len(block) else block.float() for block in t.split(sizes)])


class _EmulatedFp8GroupedMM(torch.autograd.Function):
    """x [N, a] · w_t [G, a, b] per row group with torchao's rowwise FP8 casts (module
    docstring), the GEMMs in fp32 on the dequantized values -> [N, b] in x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor):
        ctx.save_for_backward(x, w_t, offsets)
        y = torch._grouped_mm(_qdq(x, -1), _qdq(w_t, 1), offs=offsets)  # [N, b] fp32
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_t, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # [N, b] · [G, b, a]
            w = _qdq(w_t, 2).transpose(1, 2)
            dx = torch._grouped_mm(_qdq(dy, -1), w, offs=offsets).to(x.dtype)
        if ctx.needs_input_grad[1]:  # per group x_gᵀ [a, n_g] · dy_g [n_g, b] -> [G, a, b]
            xq, dyq = _qdq_groups(x, offsets), _qdq_groups(dy, offsets)
            dw = torch._grouped_mm(xq.t(), dyq, offs=offsets).to(w_t.dtype)
        return dx, dw, None


def fp8_grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, a], w_t [G, a, b] (an expert stack's transposed view), offsets [G] int32 cumulative
    -> [N, b]: the grouped GEMM with FP8 operands (module docstring)."""
    if x.is_cuda:
        from torchao.prototype.moe_training.fp8_grouped_mm import (
            _to_fp8_rowwise_then_scaled_grouped_mm,
        )

        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w_t, offsets, out_dtype=x.dtype)
    return _EmulatedFp8GroupedMM.apply(x, w_t, offsets)
