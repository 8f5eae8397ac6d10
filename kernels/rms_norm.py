"""Fused RMSNorm (optionally with the residual add folded in): Triton kernels + torch reference.

    y = x / sqrt(mean(x², -1) + eps) * weight              x: [..., h], weight: [h]
    y, s = norm(s) * weight, s    where s = x + residual    (pre-norm transformer block)

Forward: one program per row, stats in fp32, rstd [rows] kept for the backward. Backward: each
program walks a contiguous block of rows, writes dx per row and one fp32 partial dweight row;
the partials [programs, h] are summed by torch (a few hundred rows, negligible traffic).
"""

from __future__ import annotations

import torch
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
def _rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD,
    stride_x, stride_r, stride_y, stride_s, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = (x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(
            S.dtype.element_ty
        )
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)  # normalize the sum as stored (rounded to the input dtype)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, DS, X, W, RSTD, DX, DW_PART,
    stride_dy, stride_ds, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    HAS_DS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        dxhat = dy * w
        # d/dx of x·rstd: rstd·(dxhat - xhat·mean(dxhat·xhat))
        dx = rstd * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / n_cols))
        if HAS_DS:
            dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)


def rms_norm_reference(x, weight, eps=1e-6, residual=None):
    """Plain torch RMSNorm (autograd via torch); same contract as `rms_norm`."""
    s = x if residual is None else x + residual
    cdt = compute_dtype(x.dtype)
    xf = s.to(cdt)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cdt)).to(x.dtype)
    return y if residual is None else (y, s)


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm; returns y, or (y, x + residual) when a residual is given."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        h = x.shape[-1]
        if h > MAX_HIDDEN:
            raise ValueError(f"rms_norm: hidden size {h} exceeds the fused limit {MAX_HIDDEN}")
        block = triton.next_power_of_2(h)
        x2d, weight = as_rows(x), weight.contiguous()  # the kernel indexes weight densely
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        y2d = y.view(-1, h)
        rstd = torch.empty(x2d.shape[0], dtype=torch.float32, device=x.device)
        s2d = x2d
        if residual is not None:
            r2d = as_rows(residual)
            s2d = torch.empty_like(y2d)
        else:
            r2d = x2d  # unused by the kernel (HAS_RESIDUAL=False)
        launch(_rms_norm_fwd_kernel, (x2d.shape[0],),
            x2d, r2d, weight, y2d, s2d, rstd,
            x2d.stride(0), r2d.stride(0), y2d.stride(0), s2d.stride(0), h, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=block, num_warps=num_warps_for(block),
        )  # fmt: skip
        ctx.save_for_backward(s2d, weight, rstd)
        ctx.x_shape = x.shape
        ctx.has_residual = residual is not None
        ctx.set_materialize_grads(False)
        if residual is None:
            return y
        return y, s2d.view(x.shape)

    @staticmethod
    def backward(ctx, dy, ds=None):
        s2d, weight, rstd = ctx.saved_tensors
        rows, h = s2d.shape
        dy2d = as_rows(dy) if dy is not None else torch.zeros_like(s2d)  # only s was used
        ds2d = as_rows(ds) if ds is not None else dy2d
        dx = torch.empty_like(s2d)
        programs = num_programs(s2d, rows)
        rows_per_program = triton.cdiv(rows, programs)
        programs = triton.cdiv(rows, rows_per_program)
        dw_part = torch.empty((programs, h), dtype=torch.float32, device=s2d.device)
        block = triton.next_power_of_2(h)
        launch(_rms_norm_bwd_kernel, (programs,),
            dy2d, ds2d, s2d, weight, rstd, dx, dw_part,
            dy2d.stride(0), ds2d.stride(0), s2d.stride(0), dx.stride(0), rows, h,
            rows_per_program, HAS_DS=ds is not None, BLOCK_N=block,
            num_warps=num_warps_for(block),
        )  # fmt: skip
        dweight = dw_part.sum(0).to(weight.dtype)
        dx = dx.view(ctx.x_shape)
        dres = dx if ctx.has_residual else None
        return dx, dweight, dres, None


def _self_check(device: torch.device, dtype: torch.dtype, shape_class) -> None:
    """Both kernels, without and with the fused residual add, vs the reference (selfcheck.py)."""
    h, weight_dtype = shape_class
    gen = selfcheck.generator(device)
    rows = norm_check_rows(device, h)
    x, r = (selfcheck.sample((rows, h), dtype, device, gen) for _ in range(2))
    w = selfcheck.sample((h,), weight_dtype, device, gen)
    fused = lambda x, w: RMSNormFunction.apply(x, w, None, 1e-6)
    selfcheck.compare_op(fused, lambda x, w: rms_norm_reference(x, w), [x, w], dtype, gen)
    fused = lambda x, w, r: RMSNormFunction.apply(x, w, r, 1e-6)
    ref = lambda x, w, r: rms_norm_reference(x, w, residual=r)
    selfcheck.compare_op(fused, ref, [x, w, r], dtype, gen)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
):
    """RMSNorm over the last dim of x [..., h] with weight [h]; fp32 math, x's dtype out.

    With `residual` (same shape as x) the norm is applied to s = x + residual and (y, s) is
    returned, so a pre-norm block can carry s forward as its next residual.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} "
            f"{x.dtype}: cast or reshape it before the fused add + norm"
        )
    if x.numel() == 0 or not use_triton(x, "rms_norm", (x.shape[-1], weight.dtype), _self_check):
        return rms_norm_reference(x, weight, eps, residual)
    return RMSNormFunction.apply(x, weight, residual, eps)
