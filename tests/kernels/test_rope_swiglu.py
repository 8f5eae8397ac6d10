"""RoPE and SwiGLU vs their torch references (elementwise kernels, any shape)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.kernels import apply_rope, apply_rope_reference, swiglu, swiglu_reference
from tests.kernels.helpers import DEVICE, check_op, dtype_params, randn

# [s, b, n, d]: d/2 below, at and above a power of two; one head; several rows per position
ROPE_SHAPES = [(1, 1, 1, 2), (5, 2, 3, 10), (3, 2, 5, 34), (7, 1, 2, 64)]
SWIGLU_SHAPES = [(1,), (3, 37), (2, 5, 2049), (4097,)]  # 2048 = one program's block


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope(triton_backend, poisoned_empty, shape, dtype):
    s, d = shape[0], shape[-1]
    x = randn(*shape, dtype=dtype)
    cos, sin = randn(s, d, grad=False), randn(s, d, grad=False)  # arbitrary, not just cos/sin
    check_op(lambda x: apply_rope(x, cos, sin), lambda x: apply_rope_reference(x, cos, sin), [x],
             dtype)  # fmt: skip


@pytest.mark.parametrize("shape", ROPE_SHAPES[1:], ids=str)
def test_rope_per_token_tables(triton_backend, shape):
    """[s, b, d] tables (per-document positions) rotate each sequence b like its own [s, d]
    table, forward and backward, on either backend."""
    s, b, _, d = shape
    x = randn(*shape)
    angles = randn(s, b, d, grad=False) * 3
    cos, sin = angles.cos(), angles.sin()
    out = apply_rope(x, cos, sin)
    gout = randn(*out.shape, grad=False)
    (dx,) = torch.autograd.grad(out, x, gout)
    for r in range(b):
        xr = x[:, r : r + 1].detach().requires_grad_()
        want = apply_rope(xr, cos[:, r], sin[:, r])
        (want_dx,) = torch.autograd.grad(want, xr, gout[:, r : r + 1])
        torch.testing.assert_close(out[:, r : r + 1], want, msg=f"sequence {r}: forward")
        torch.testing.assert_close(dx[:, r : r + 1], want_dx, msg=f"sequence {r}: backward")
    check_op(lambda x: apply_rope(x, cos, sin), lambda x: apply_rope_reference(x, cos, sin), [x],
             torch.float32)  # fmt: skip


def test_rope_non_contiguous_input(triton_backend):
    """q sliced out of a fused qkv projection is a strided view."""
    qkv = randn(4, 2, 3, 3 * 16, grad=False)
    q = qkv[..., :16].requires_grad_()
    cos, sin = randn(4, 16, grad=False), randn(4, 16, grad=False)
    check_op(lambda x: apply_rope(x, cos, sin), lambda x: apply_rope_reference(x, cos, sin), [q],
             torch.float32)  # fmt: skip


def test_rope_reference_is_llama_rotation():
    """With Llama tables (cos/sin = cat(θ, θ)), element i and i + d/2 rotate by angle θ_i."""
    s, d = 6, 8
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    theta = torch.outer(torch.arange(s).float(), inv_freq)  # [s, d/2]
    cos, sin = torch.cat([theta, theta], -1).cos(), torch.cat([theta, theta], -1).sin()
    x = torch.randn(s, 2, 3, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, sn = theta.cos()[:, None, None], theta.sin()[:, None, None]
    want = torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], -1)
    torch.testing.assert_close(apply_rope_reference(x, cos, sin), want)
    assert math.isclose(want[0].sub(x[0]).abs().max().item(), 0.0)  # position 0: identity


def test_rope_shape_errors():
    with pytest.raises(ValueError, match="even d"):
        apply_rope(randn(2, 1, 1, 5), randn(2, 5), randn(2, 5))
    with pytest.raises(ValueError, match="cos must be"):
        apply_rope(randn(2, 1, 1, 4), randn(3, 4), randn(2, 4))
    with pytest.raises(ValueError, match="cos and sin alike"):
        apply_rope(randn(2, 3, 1, 4), randn(2, 3, 4), randn(2, 4))


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=str)
def test_swiglu(triton_backend, poisoned_empty, shape, dtype):
    gate, up = randn(*shape, dtype=dtype, scale=3.0), randn(*shape, dtype=dtype)
    check_op(swiglu, swiglu_reference, [gate, up], dtype)


def test_swiglu_reference_matches_definition():
    gate, up = torch.randn(5, 7, device=DEVICE), torch.randn(5, 7, device=DEVICE)
    torch.testing.assert_close(swiglu_reference(gate, up), gate * torch.sigmoid(gate) * up)
    torch.testing.assert_close(swiglu_reference(gate, up), F.silu(gate) * up)


def test_swiglu_shape_error():
    with pytest.raises(ValueError, match="same shape"):
        swiglu(randn(2, 4), randn(2, 5))
