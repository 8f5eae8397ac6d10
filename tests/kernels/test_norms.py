"""RMSNorm (with and without the fused residual add) and LayerNorm vs their torch references."""

import pytest
import torch

from megatron_lite.kernels import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from tests.kernels.helpers import check_op, dtype_params, randn

# odd hidden sizes, tails smaller than a block, a single row, rows not divisible by programs
SHAPES = [(1, 1), (3, 37), (2, 5, 64), (9, 130), (4, 2, 257)]
# hidden 1 is degenerate for LayerNorm (x - mean is exactly 0 here, rounding noise in torch)
LN_SHAPES = [(1, 3), *SHAPES[1:]]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm(triton_backend, poisoned_empty, shape, dtype):
    x, w = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype)
    fn = lambda x, w: rms_norm(x, w, eps=1e-6)
    ref = lambda x, w: rms_norm_reference(x, w, eps=1e-6)
    check_op(fn, ref, [x, w], dtype)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_rms_norm_residual(triton_backend, poisoned_empty, shape, dtype):
    """y, s = norm(x + residual), x + residual: both outputs and all three grads."""
    x, r, w = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype)
    fn = lambda x, w, r: rms_norm(x, w, eps=1e-6, residual=r)
    ref = lambda x, w, r: rms_norm_reference(x, w, eps=1e-6, residual=r)
    check_op(fn, ref, [x, w, r], dtype)


def test_rms_norm_residual_sum_unused(triton_backend):
    """Only y feeds the loss (the sum's grad is None): dx = dresidual = dnorm."""
    x, r, w = randn(3, 37), randn(3, 37), randn(37)
    y, _ = rms_norm(x, w, residual=r)
    y_ref, _ = rms_norm_reference(x, w, residual=r)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w, r], g)
    want = torch.autograd.grad(y_ref, [x, w, r], g)
    for name, a, b in zip(("x", "weight", "residual"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_rms_norm_non_contiguous_input(triton_backend):
    """A strided view (every other row) goes through the kernels' row strides."""
    base = randn(10, 48, grad=False)
    x = base[::2].requires_grad_()
    w = randn(48)
    check_op(lambda x, w: rms_norm(x, w), rms_norm_reference, [x, w], torch.float32)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", LN_SHAPES, ids=str)
def test_layer_norm(triton_backend, poisoned_empty, shape, dtype):
    x = randn(*shape, dtype=dtype)
    w, b = randn(shape[-1], dtype=dtype), randn(shape[-1], dtype=dtype)
    fn = lambda x, w, b: layer_norm(x, w, b, eps=1e-5)
    ref = lambda x, w, b: layer_norm_reference(x, w, b, eps=1e-5)
    check_op(fn, ref, [x, w, b], dtype)


def test_layer_norm_without_bias(triton_backend, poisoned_empty):
    x, w = randn(5, 3, 45, scale=3.0), randn(45)
    fn = lambda x, w: layer_norm(x, w, None)
    check_op(fn, lambda x, w: layer_norm_reference(x, w, None), [x, w], torch.float32)


def test_layer_norm_reference_matches_torch():
    """The reference itself is F.layer_norm in fp32 (guards against editing it by mistake)."""
    x, w, b = randn(4, 33, grad=False), randn(33, grad=False), randn(33, grad=False)
    want = torch.nn.functional.layer_norm(x, (33,), w, b, 1e-5)
    torch.testing.assert_close(layer_norm_reference(x, w, b), want)


def test_norm_shape_errors():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(randn(2, 8), randn(4))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(randn(2, 8), randn(8), residual=randn(2, 4))
    with pytest.raises(ValueError, match="bias shape"):
        layer_norm(randn(2, 8), randn(8), randn(3))
