"""The kernels' one-time self-check (kernels/selfcheck.py), driven through the interpreter in
fp32 by saying "this device compiles Triton" for CPU tensors: automatic dispatch runs a kernel
only after it matched its reference for the shape class, once per class; a kernel that computes
wrong values, or fails, sends the op to torch with one warning naming it; forcing a backend
bypasses the check."""

import importlib
import warnings

import pytest
import torch
import triton
import triton.language as tl

from megatron_lite import kernels
from megatron_lite.kernels import ENV_VAR, dispatch, selfcheck
from tests.kernels.helpers import randn

MODULES = {
    name: importlib.import_module(f"megatron_lite.kernels.{name}")
    for name in ("rms_norm", "layer_norm", "rope", "swiglu", "cross_entropy")
}
TRITON_BACKWARD = {
    "rms_norm": "RMSNormFunctionBackward",
    "layer_norm": "LayerNormFunctionBackward",
    "rope": "RoPEFunctionBackward",
    "swiglu": "SwiGLUFunctionBackward",
    "cross_entropy": "CrossEntropyFunctionBackward",
}


def _inputs(kernel: str, width: int) -> tuple:
    """Small fp32 arguments of the public op (width: the feature size the class is keyed on)."""
    if kernel == "rms_norm":
        return randn(5, width), randn(width)
    if kernel == "layer_norm":
        return randn(5, width), randn(width), randn(width)
    if kernel == "rope":
        angles = torch.randn(3, width)
        return randn(3, 2, 2, width), angles.cos(), angles.sin()
    if kernel == "swiglu":
        return randn(4, width), randn(4, width)
    return randn(5, width), torch.randint(0, width, (5,))


OPS = {
    "rms_norm": kernels.rms_norm,
    "layer_norm": kernels.layer_norm,
    "rope": kernels.apply_rope,
    "swiglu": kernels.swiglu,
    "cross_entropy": kernels.cross_entropy,
}


def _call(kernel: str, width: int = 16, rng_untouched: bool = False) -> torch.Tensor:
    """The public op on fresh inputs; optionally assert it left the global RNG as it was."""
    args = _inputs(kernel, width)
    state = torch.get_rng_state()
    out = OPS[kernel](*args)
    if rng_untouched:
        assert torch.equal(torch.get_rng_state(), state), "the self-check drew from the global RNG"
    return out


def _ran_triton(kernel: str, out: torch.Tensor) -> bool:
    if kernel == "cross_entropy":  # one autograd function for both paths: its ctx says which
        (node, _), *_ = out.grad_fn.next_functions  # the loss is a view of its output
        return type(node).__name__ == TRITON_BACKWARD[kernel] and node.meta[1]
    return type(out.grad_fn).__name__ == TRITON_BACKWARD[kernel]


@pytest.fixture
def auto_on_gpu(monkeypatch):
    """Automatic dispatch, with CPU tensors treated as the compiled-Triton device (the kernels
    then run in the interpreter); a fresh verdict cache before and after."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "compiles_triton", lambda x: True)
    selfcheck.clear()
    yield
    selfcheck.clear()


def _counting(monkeypatch, kernel: str) -> list:
    """Count the calls of `kernel`'s self-check (still running the real one)."""
    module, calls = MODULES[kernel], []
    real = module._self_check

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(module, "_self_check", counted)
    return calls


def _kernel_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "self-check" in str(w.message)]


@pytest.mark.parametrize("kernel", MODULES)
def test_a_correct_kernel_passes_once_per_shape_class(auto_on_gpu, monkeypatch, kernel):
    """Two calls of one class and one of another: two checks, both passed, Triton ran each
    time, no warning, and the model's RNG stream untouched. The first call is under no_grad
    (an evaluation): the check still runs its backward."""
    calls = _counting(monkeypatch, kernel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            _call(kernel, 16, rng_untouched=True)
        outs = [_call(kernel, 16), _call(kernel, 24)]
    assert _kernel_warnings(caught) == []
    assert all(_ran_triton(kernel, out) for out in outs), "auto dispatch did not run Triton"
    expected = 1 if kernel == "swiglu" else 2  # swiglu's kernels are flat: one class per dtype
    assert len(calls) == expected, f"{kernel}: {len(calls)} self-checks, expected {expected}"
    assert list(selfcheck.verdicts().values()) == [None] * expected


@triton.jit
def _rms_norm_forgets_the_weight(
    X, R, W, Y, S, RSTD,
    stride_x, stride_r, stride_y, stride_s, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The real forward kernel's signature and layout, but y = x·rstd (no ·weight)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(S + row * stride_s + cols, x, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * stride_y + cols, x * rstd, mask=mask)


def _forgets_the_weight(monkeypatch):
    monkeypatch.setattr(MODULES["rms_norm"], "_rms_norm_fwd_kernel", _rms_norm_forgets_the_weight)


def _wrong_weight_gradient(monkeypatch):
    function = MODULES["rms_norm"].RMSNormFunction
    real = function.backward

    def backward(ctx, *grads):
        dx, dweight, *rest = real(ctx, *grads)
        return (dx, dweight * 1.01, *rest)

    monkeypatch.setattr(function, "backward", staticmethod(backward))


def _failing_launch(monkeypatch, kernel):
    def launch(fn, grid, *args, **meta):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(MODULES[kernel], "launch", launch)


BROKEN = {  # kernel, how it is broken, what the warning must name
    "rms_norm_wrong_output": ("rms_norm", _forgets_the_weight, "output 0: "),
    "rms_norm_wrong_weight_grad": ("rms_norm", _wrong_weight_gradient, "gradient of input 1: "),
    **{
        f"{k}_launch_fails": (k, lambda mp, k=k: _failing_launch(mp, k), "illegal memory access")
        for k in MODULES
    },
}  # fmt: skip


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_kernel_falls_back_to_torch_with_one_warning(auto_on_gpu, monkeypatch, case):
    kernel, breaks, reason = BROKEN[case]
    breaks(monkeypatch)
    with pytest.warns(RuntimeWarning) as caught:
        first = _call(kernel)
        second = _call(kernel)  # cached: no second check, no second warning
    messages = _kernel_warnings(caught)
    assert len(messages) == 1, messages
    assert f"the Triton {kernel} kernel failed its self-check" in messages[0], messages[0]
    assert "torch.float32" in messages[0] and reason in messages[0], messages[0]
    assert f"{kernel} runs the torch reference" in messages[0], messages[0]
    for out in (first, second):
        assert not _ran_triton(kernel, out), f"{kernel} still dispatched to the broken kernel"
    (verdict,) = selfcheck.verdicts().values()
    assert reason in verdict


@pytest.mark.parametrize("backend, runs_triton", [("triton", True), ("torch", False)])
def test_forcing_a_backend_bypasses_the_check(auto_on_gpu, monkeypatch, backend, runs_triton):
    """MEGATRON_LITE_KERNELS=triton runs even a kernel whose check would fail, unchecked;
    =torch never runs the kernel nor its check."""
    monkeypatch.setenv(ENV_VAR, backend)
    calls = _counting(monkeypatch, "rms_norm")
    _forgets_the_weight(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _call("rms_norm")
    assert calls == [] and _kernel_warnings(caught) == [] and selfcheck.verdicts() == {}
    assert _ran_triton("rms_norm", out) is runs_triton


def test_auto_without_a_compiling_device_runs_torch_unchecked(monkeypatch):
    """A CPU tensor under automatic dispatch (no monkeypatch): torch, and no check at all."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    selfcheck.clear()
    calls = _counting(monkeypatch, "rms_norm")
    assert not _ran_triton("rms_norm", _call("rms_norm"))
    assert calls == [] and selfcheck.verdicts() == {}
