"""Shared helpers for the kernel tests: device, dtypes, inputs, comparisons."""

import pytest
import torch

from megatron_lite.kernels import selfcheck
from megatron_lite.kernels.selfcheck import TOLERANCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF_SKIP = "needs a GPU: the Triton interpreter's bf16 arithmetic is broken upstream"

# TOLERANCES: (atol, rtol) per dtype for outputs and gradients against the fp32-math torch
# reference; the kernels' self-check (kernels/selfcheck.py) holds them to the same bounds


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


def check_op(fn, ref, inputs, dtype):
    """Run fn and ref on the same inputs with the same random output grads; compare the
    outputs (dtype, shape, values) and the gradient of every input that requires grad, as the
    kernels' self-check does (output grads drawn from the test's seeded stream)."""
    gen = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(2**62, ())))
    selfcheck.compare_op(fn, ref, inputs, dtype, gen)
