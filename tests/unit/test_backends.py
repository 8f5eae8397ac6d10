"""Attention/linear backend selection and its error messages (CPU machine: no CUDA)."""

import pytest
import torch

from megatron_lite.config import ConfigError, load_config
from megatron_lite.models.backends import resolve_attention_backend, sdpa_attention
from megatron_lite.validation import check_hardware, validate


def _validate(*overrides):
    cfg = validate(load_config(None, ["data.mock=true", "model.vocab_size=64", *overrides]), 1)
    check_hardware(cfg)
    return cfg


def test_auto_is_sdpa_without_cuda_or_in_fp32():
    assert resolve_attention_backend("auto", "fp32") == "sdpa"
    assert resolve_attention_backend("sdpa", "fp32") == "sdpa"
    if not torch.cuda.is_available():
        assert resolve_attention_backend("auto", "bf16") == "sdpa"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize(
    "backend, package", [("flash", "flash_attn"), ("te", "transformer_engine")]
)
def test_gpu_backends_on_cpu_name_package_and_fix(backend, package):
    with pytest.raises(ConfigError) as e:
        _validate(f"model.attention_backend={backend}")
    msg = str(e.value)
    assert f"model.attention_backend={backend!r}" in msg and package in msg and "Fix:" in msg


def test_missing_package_names_install_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("megatron_lite.models.backends._installed", lambda m: False)
    with pytest.raises(ValueError, match="pip install flash-attn"):
        resolve_attention_backend("flash", "bf16")
    with pytest.raises(ValueError, match="transformer-engine"):
        resolve_attention_backend("te", "bf16")
    assert resolve_attention_backend("auto", "bf16") == "sdpa"  # never a missing package


def test_flash_needs_bf16_and_auto_never_changes_fp32_math(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("megatron_lite.models.backends._installed", lambda m: True)
    with pytest.raises(ValueError, match="train.precision=bf16"):
        resolve_attention_backend("flash", "fp32")
    assert resolve_attention_backend("auto", "fp32") == "sdpa"
    assert resolve_attention_backend("auto", "bf16") == "flash"


def test_te_linear_backend_is_rejected_clearly():
    with pytest.raises(ConfigError, match="model.linear_backend='te'"):
        _validate("model.linear_backend=te")


def test_sdpa_gqa_matches_float64_softmax_attention():
    torch.manual_seed(0)
    s, b, n, g, d = 5, 2, 4, 2, 3
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for h in (n, g, g))
    out = sdpa_attention(q, k, v, 0.0)
    kk, vv = k.repeat_interleave(n // g, 2), v.repeat_interleave(n // g, 2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, kk) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), vv)
    assert (out - ref).abs().max() < 1e-12
