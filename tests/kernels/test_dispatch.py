"""Backend dispatch: MEGATRON_LITE_KERNELS is read at call time and errors say how to fix."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_lite.kernels import ENV_VAR, rms_norm, selfcheck, use_triton
from tests.kernels.helpers import randn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def backward_name(y):
    return type(y.grad_fn).__name__


def _never(*args):
    raise AssertionError("the self-check ran")


def test_auto_uses_torch_for_cpu_tensors(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    x = torch.randn(3, device="cpu")
    assert use_triton(x, "swiglu", None, _never) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA tensor")
def test_auto_uses_triton_for_cuda_tensors_that_pass_their_check(monkeypatch):
    """On a GPU: the real self-check of the compiled swiglu kernels, in each dtype."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    check = importlib.import_module("megatron_lite.kernels.swiglu")._self_check
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3, device="cuda", dtype=dtype)
        assert use_triton(x, "swiglu", None, check) is True, selfcheck.verdicts()


def test_env_var_is_read_at_call_time(monkeypatch):
    """The same call switches between the Triton autograd function and the torch reference."""
    x, w = randn(4, 16), randn(16)
    monkeypatch.setenv(ENV_VAR, "triton")
    assert backward_name(rms_norm(x, w)) == "RMSNormFunctionBackward"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert backward_name(rms_norm(x, w)) != "RMSNormFunctionBackward"


def test_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=f"{ENV_VAR}='cuda' is not one of auto, triton, torch"):
        rms_norm(randn(2, 8), randn(8))


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 8), torch.randn(8))


@pytest.mark.slow  # in CI's slow tier (bash tests/run.sh -m slow): keeps the suite under 10 min
def test_interpreter_enabled_after_triton_import_is_an_error():
    """Setting TRITON_INTERPRET after `import triton` cannot work (triton.language's helpers
    are already compiled for a GPU); the error must say so instead of a deep interpreter one."""
    script = textwrap.dedent(f"""
        import os, torch
        from megatron_lite.kernels import rms_norm
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["{ENV_VAR}"] = "triton"
        try:
            rms_norm(torch.randn(2, 8), torch.randn(8))
        except RuntimeError as e:
            print(e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert "triton was imported before it was" in out.stdout, out.stdout + out.stderr


def test_fp64_runs_the_torch_reference_in_fp64(monkeypatch):
    """Exact parity tests run in fp64: auto dispatch keeps them on torch, computing in fp64."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    x, w = torch.randn(3, 40, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w), want, atol=1e-14, rtol=1e-14)


def test_forcing_triton_on_fp64_is_an_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    with pytest.raises(ValueError, match="not torch.float64"):
        rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64))
