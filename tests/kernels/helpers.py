"""Shared helpers for the kernel tests: device, dtypes, inputs, comparisons."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF_SKIP = "needs a GPU: the Triton interpreter's bf16 arithmetic is broken upstream"

# (dtype, atol, rtol) for outputs and gradients against the fp32-math torch reference
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}


def dtype_params():
    """fp32 everywhere; bf16/fp16 only where a GPU runs the compiled kernels."""
    half = pytest.mark.skipif(DEVICE == "cpu", reason=HALF_SKIP)
    return [
        pytest.param(torch.float32, id="fp32"),
        pytest.param(torch.bfloat16, id="bf16", marks=half),
        pytest.param(torch.float16, id="fp16", marks=half),
    ]


def randn(*shape, dtype=torch.float32, scale=1.0, grad=True):
    """Fresh random input on the test device (never zeros), optionally requiring grad."""
    t = (torch.randn(*shape, device=DEVICE) * scale).to(dtype)
    return t.requires_grad_(grad)


def check_close(name, got, want, dtype):
    """assert_close with the dtype's tolerance and a message naming the diverging tensor."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        got.float(), want.float(), atol=atol, rtol=rtol,
        msg=lambda m: f"{name} diverges from the torch reference ({dtype}):\n{m}",
    )  # fmt: skip


def check_op(fn, ref, inputs, dtype, n_out=1):
    """Run fn and ref on the same inputs with the same random output grads; compare the
    outputs and the gradient of every input that requires grad."""
    outs, refs = fn(*inputs), ref(*inputs)
    if n_out == 1:
        outs, refs = (outs,), (refs,)
    assert all(o.dtype == r.dtype and o.shape == r.shape for o, r in zip(outs, refs, strict=True))
    grads = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in outs]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(refs, leaves, grads)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        check_close(f"output {i}", o, r, dtype)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        check_close(f"grad of input {i}", g, w, dtype)
