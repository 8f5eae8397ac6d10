"""Fused rotary position embedding, half-rotation (Llama / GPT-NeoX) convention.

    out = x·cos + rotate_half(x)·sin,   rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])

x: [s, b, n, d] (sequence first, as everywhere in the stack); cos, sin: [s, d] (one table for
every sequence of the batch) or [s, b, d] (a table per token: per-document positions). Each
program rotates BLOCK_R rows of d (a row is one head of one token); the backward is the same
kernel with the rotation transposed (sin negated on the other half), since d out/dx is a
rotation. Row r reads table row r // rows_per_pos: b·n rows share an [s, d] table row, n rows
(the heads of one token) an [s, b, d] one, so both layouts run the same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_lite.kernels import selfcheck
from megatron_lite.kernels.dispatch import compute_dtype, launch, use_triton

ELEMENTS_PER_PROGRAM = 4096  # rows per program = this / d, so a program moves ~16 KB of fp32


@triton.jit
def _rope_kernel(
    X, COS, SIN, OUT, n_rows, rows_per_pos, half,
    BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
    x_off = rows[:, None] * (2 * half) + cols[None, :]  # [BLOCK_R, BLOCK_H], first half
    cs_off = (rows // rows_per_pos)[:, None] * (2 * half) + cols[None, :]  # position of each row
    x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + cs_off, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs_off + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs_off, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs_off + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of [[c1, -s1], [s2, c2]]
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(OUT + x_off, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + x_off + half, o2.to(OUT.dtype.element_ty), mask=mask)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch RoPE: x [s, b, n, d], cos/sin [s, d] or [s, b, d] -> [s, b, n, d] in x's
    dtype."""
    cdt = compute_dtype(x.dtype)
    if cos.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]  # [s, 1, d]: every sequence alike
    cos = cos.to(cdt)[:, :, None, :]  # [s, b or 1, 1, d]
    sin = sin.to(cdt)[:, :, None, :]
    xf = x.to(cdt)
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool):
    s, b, n, d = x.shape
    out = torch.empty_like(x)
    half = d // 2
    block_h = triton.next_power_of_2(half)
    block_r = max(ELEMENTS_PER_PROGRAM // (2 * block_h), 1)
    n_rows = s * b * n
    rows_per_pos = b * n if cos.dim() == 2 else n  # tokens of a table row: [s, d] or [s, b, d]
    launch(_rope_kernel, (triton.cdiv(n_rows, block_r),),
        x, cos, sin, out, n_rows, rows_per_pos, half,
        BACKWARD=backward, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return out


class RoPEFunction(torch.autograd.Function):
    """Triton RoPE; differentiable w.r.t. x only."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _launch(x.contiguous(), cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dout):
        cos, sin = ctx.saved_tensors
        return _launch(dout.contiguous(), cos, sin, backward=True), None, None


def _self_check(device: torch.device, dtype: torch.dtype, shape_class) -> None:
    """Forward and backward kernel vs the reference on two programs of rows and a partial third
    (selfcheck.py); cos/sin from real angles, as the model's tables are ([s, b, d] tables
    per token: two sequences)."""
    d, table_dtype, table_dims = shape_class
    gen = selfcheck.generator(device)
    rows = 2 * max(ELEMENTS_PER_PROGRAM // (2 * triton.next_power_of_2(d // 2)), 1) + 3
    b = 1 if table_dims == 2 else 2
    x = selfcheck.sample((-(-rows // b), b, 1, d), dtype, device, gen)  # [s, b, n, d]
    table = (x.shape[0], d) if table_dims == 2 else (x.shape[0], b, d)
    angles = selfcheck.sample(table, torch.float32, device, gen, requires_grad=False) * 3
    cos, sin = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
    fused = lambda x: RoPEFunction.apply(x, cos, sin)
    selfcheck.compare_op(fused, lambda x: apply_rope_reference(x, cos, sin), [x], dtype, gen)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, n, d] by cos/sin [s, d], or [s, b, d] for per-token positions
    (half-rotation convention); fp32 math. Both table layouts run the Triton kernel.

    Gradients flow to x only (cos and sin are treated as constants by the Triton path).
    """
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: x must be [s, b, n, d] with even d, got {tuple(x.shape)}")
    s, b, d = x.shape[0], x.shape[1], x.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape not in ((s, d), (s, b, d)) or t.shape != cos.shape:
            raise ValueError(
                f"apply_rope: {name} must be [s, d] = [{s}, {d}] or [s, b, d] = [{s}, {b}, {d}] "
                f"(cos and sin alike), got {tuple(t.shape)} (slice the table to the local "
                "sequence first)"
            )
    shape_class = (d, cos.dtype, cos.dim())
    if x.numel() == 0 or not use_triton(x, "rope", shape_class, _self_check):
        return apply_rope_reference(x, cos, sin)
    return RoPEFunction.apply(x, cos, sin)
