"""Fused SwiGLU activation: out = silu(gate) * up, elementwise over any (equal) shapes.

The forward reads gate and up once and writes out; the backward recomputes silu from the saved
inputs instead of keeping the activation, so only gate and up are held for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megatron_lite.kernels import selfcheck
from megatron_lite.kernels.dispatch import compute_dtype, launch, use_triton

BLOCK = 2048  # elements per program: 16 per thread at 4 warps, enough bytes in flight


@triton.jit
def _swiglu_fwd_kernel(GATE, UP, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DOUT, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu/dg = sig + g·sig·(1 - sig) = sig·(1 + g·(1 - sig))
    dgate = dout * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DGATE + offs, dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, (dout * silu).to(DUP.dtype.element_ty), mask=mask)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch silu(gate) * up in fp32, returned in gate's dtype."""
    cdt = compute_dtype(gate.dtype)
    return (F.silu(gate.to(cdt)) * up.to(cdt)).to(gate.dtype)


class SwiGLUFunction(torch.autograd.Function):
    """Triton silu(gate) * up; gate, up: [...] of one shape and dtype."""

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        launch(
            _swiglu_fwd_kernel, (triton.cdiv(n, BLOCK),), gate, up, out, n, BLOCK=BLOCK, num_warps=4
        )
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        launch(
            _swiglu_bwd_kernel,
            (triton.cdiv(n, BLOCK),),
            dout,
            gate,
            up,
            dgate,
            dup,
            n,
            BLOCK=BLOCK,
            num_warps=4,
        )
        return dgate, dup


def _self_check(device: torch.device, dtype: torch.dtype, shape_class) -> None:
    """Both kernels vs the reference on two blocks and a partial third (selfcheck.py). The
    kernels are flat over the elements: one class per dtype (shape_class is None)."""
    gen = selfcheck.generator(device)
    gate, up = (selfcheck.sample((2 * BLOCK + 5,), dtype, device, gen, scale=3) for _ in range(2))
    selfcheck.compare_op(SwiGLUFunction.apply, swiglu_reference, [gate, up], dtype, gen)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up of the same shape [..., f] and dtype; fp32 math."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
            "must have the same shape and dtype (split the fused [.., 2f] projection first)"
        )
    if gate.numel() == 0 or not use_triton(gate, "swiglu", None, _self_check):
        return swiglu_reference(gate, up)
    return SwiGLUFunction.apply(gate, up)
