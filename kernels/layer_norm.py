"""Fused LayerNorm over the last dim: Triton kernels + torch reference.

    y = (x - mean) / sqrt(var + eps) * weight + bias        x: [..., h], weight, bias: [h]

Same structure as rms_norm.py: one program per row forward (mean and rstd [rows] saved), and a
backward where each program owns a block of rows and writes fp32 partial dweight / dbias rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megatron_lite.kernels import selfcheck
from megatron_lite.kernels.dispatch import (
    MAX_HIDDEN,
    as_rows,
    compute_dtype,
    launch,
    norm_check_rows,
    num_programs,
    num_warps_for,
    use_triton,
)


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_cols, eps,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)  # padded lanes must not count in the variance
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - tl.load(MEAN + row)) * tl.load(RSTD + row), 0.0)
        dxhat = dy * w
        # dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat))
        c1 = tl.sum(dxhat * xhat, axis=0) / n_cols
        c2 = tl.sum(dxhat, axis=0) / n_cols
        dx = (dxhat - c2 - xhat * c1) * tl.load(RSTD + row)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * n_cols + cols, db, mask=mask)


def layer_norm_reference(x, weight, bias=None, eps=1e-5):
    """Plain torch LayerNorm in fp32 (fp64 for fp64) (autograd via torch), x's dtype out."""
    cdt = compute_dtype(x.dtype)
    b = bias.to(cdt) if bias is not None else None
    return F.layer_norm(x.to(cdt), x.shape[-1:], weight.to(cdt), b, eps).to(x.dtype)


class LayerNormFunction(torch.autograd.Function):
    """Triton LayerNorm over the last dim; bias may be None."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        h = x.shape[-1]
        if h > MAX_HIDDEN:
            raise ValueError(f"layer_norm: hidden size {h} exceeds the fused limit {MAX_HIDDEN}")
        block = triton.next_power_of_2(h)
        x2d, weight = as_rows(x), weight.contiguous()  # the kernel indexes weight densely
        bias = bias.contiguous() if bias is not None else None
        rows = x2d.shape[0]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        y2d = y.view(-1, h)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        launch(_layer_norm_fwd_kernel, (rows,),
            x2d, weight, bias if bias is not None else weight, y2d, mean, rstd,
            x2d.stride(0), y2d.stride(0), h, eps,
            HAS_BIAS=bias is not None, BLOCK_N=block, num_warps=num_warps_for(block),
        )  # fmt: skip
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.x_shape = x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        rows, h = x2d.shape
        dy2d = as_rows(dy)
        dx = torch.empty(x2d.shape, dtype=x2d.dtype, device=x2d.device)
        programs = num_programs(x2d, rows)
        rows_per_program = triton.cdiv(rows, programs)
        programs = triton.cdiv(rows, rows_per_program)
        has_bias = ctx.bias_dtype is not None
        dw_part = torch.empty((programs, h), dtype=torch.float32, device=x2d.device)
        db_part = torch.empty_like(dw_part) if has_bias else dw_part
        block = triton.next_power_of_2(h)
        launch(_layer_norm_bwd_kernel, (programs,),
            dy2d, x2d, weight, mean, rstd, dx, dw_part, db_part,
            dy2d.stride(0), x2d.stride(0), dx.stride(0), rows, h, rows_per_program,
            HAS_BIAS=has_bias, BLOCK_N=block, num_warps=num_warps_for(block),
        )  # fmt: skip
        dbias = db_part.sum(0).to(ctx.bias_dtype) if has_bias else None
        return dx.view(ctx.x_shape), dw_part.sum(0).to(weight.dtype), dbias, None


def _self_check(device: torch.device, dtype: torch.dtype, shape_class) -> None:
    """Both kernels (with a bias when the class has one) vs the reference (selfcheck.py)."""
    h, weight_dtype, bias_dtype = shape_class
    gen = selfcheck.generator(device)
    x = selfcheck.sample((norm_check_rows(device, h), h), dtype, device, gen)
    w = selfcheck.sample((h,), weight_dtype, device, gen)
    if bias_dtype is None:
        fused = lambda x, w: LayerNormFunction.apply(x, w, None, 1e-5)
        ref = lambda x, w: layer_norm_reference(x, w, None, 1e-5)
        selfcheck.compare_op(fused, ref, [x, w], dtype, gen)
        return
    b = selfcheck.sample((h,), bias_dtype, device, gen)
    fused = lambda x, w, b: LayerNormFunction.apply(x, w, b, 1e-5)
    ref = lambda x, w, b: layer_norm_reference(x, w, b, 1e-5)
    selfcheck.compare_op(fused, ref, [x, w, b], dtype, gen)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dim of x [..., h] with weight, bias [h] (bias may be None)."""
    h = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (h,):
            raise ValueError(f"layer_norm: {name} shape {tuple(t.shape)} must be ({h},)")
    shape_class = (h, weight.dtype, None if bias is None else bias.dtype)
    if x.numel() == 0 or not use_triton(x, "layer_norm", shape_class, _self_check):
        return layer_norm_reference(x, weight, bias, eps)
    return LayerNormFunction.apply(x, weight, bias, eps)
