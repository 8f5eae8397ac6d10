"""Attention/linear backend selection and its error messages (CPU machine: no CUDA)."""

import pytest
import torch

from megatron_lite.config import ConfigError, load_config
from megatron_lite.models.attention import sdpa_attention
from megatron_lite.resolve import attention_backend as resolve_attention_backend
from megatron_lite.resolve import linear_backend as resolve_linear_backend
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
    monkeypatch.setattr("megatron_lite.optional._installed", lambda m: False)
    with pytest.raises(ValueError, match="pip install flash-attn"):
        resolve_attention_backend("flash", "bf16")
    with pytest.raises(ValueError, match="transformer-engine"):
        resolve_attention_backend("te", "bf16")
    assert resolve_attention_backend("auto", "bf16") == "sdpa"  # never a missing package


def test_flash_needs_bf16_and_auto_never_changes_fp32_math(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("megatron_lite.optional._installed", lambda m: True)
    with pytest.raises(ValueError, match="train.precision=bf16"):
        resolve_attention_backend("flash", "fp32")
    assert resolve_attention_backend("auto", "fp32") == "sdpa"
    assert resolve_attention_backend("auto", "bf16") == "flash"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_te_linear_backend_on_cpu_names_package_and_fix():
    with pytest.raises(ConfigError) as e:
        _validate("model.linear_backend=te")
    msg = str(e.value)
    assert "model.linear_backend='te'" in msg and "transformer_engine" in msg
    assert "Fix: use model.linear_backend=local" in msg


def test_te_linear_backend_missing_package_and_fp8_support(monkeypatch):
    monkeypatch.setattr("megatron_lite.optional._cuda", lambda: True)
    monkeypatch.setattr("megatron_lite.optional._installed", lambda m: False)
    with pytest.raises(ValueError, match=r"pip install 'transformer-engine\[pytorch\]'"):
        resolve_linear_backend("te", None)
    assert resolve_linear_backend("local", None) == "local"  # never needs TE
    monkeypatch.setattr("megatron_lite.optional._installed", lambda m: True)
    assert resolve_linear_backend("te", None) == "te"  # bf16 GEMMs: no FP8 check
    monkeypatch.setattr(
        "megatron_lite.parallel.te_linear.fp8_support",
        lambda recipe: (False, "Device compute capability 8.9 or higher required"),
    )
    with pytest.raises(ValueError) as e:
        resolve_linear_backend("te", "hybrid", "mxfp8")
    msg = str(e.value)
    assert "model.fp8_recipe='mxfp8'" in msg and "8.9 or higher" in msg and "Fix:" in msg


@pytest.mark.parametrize(
    "overrides, key, rule",
    [
        (["model.fp8=hybrid"], "model.fp8='hybrid'", "model.linear_backend=te"),
        (["model.fp8=e5m2", "model.linear_backend=te"], "model.fp8='e5m2'", "one of"),
        (["model.fp8_recipe=nvfp4"], "model.fp8_recipe='nvfp4'", "tensorwise, delayed"),
        (["model.fp8=hybrid", "model.linear_backend=te"], "model.fp8", "train.precision=bf16"),
        (
            ["model.seq_length=20", "train.micro_batch_size=2"],
            "model.fp8",
            "seq_length/cp × micro_batch_size = 40",
        ),
        (
            ["model.hidden_size=72", "model.ffn_hidden_size=192"],
            "model.fp8",
            "model.hidden_size = 72 must be a multiple of 16",
        ),
        (
            ["model.ffn_hidden_size=200"],
            "model.fp8",
            "model.ffn_hidden_size / tp = 200",
        ),
    ],
)
def test_fp8_config_errors_name_key_rule_and_fix(overrides, key, rule):
    fp8 = ["model.fp8=hybrid", "model.linear_backend=te", "train.precision=bf16"]
    if any(o.startswith(("model.fp8=", "model.linear", "model.fp8_recipe")) for o in overrides):
        fp8 = []
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["data.mock=true", "model.vocab_size=64", *fp8, *overrides]), 1)
    msg = str(e.value)
    assert key in msg and rule in msg and "Fix:" in msg, msg


def test_fp8_config_that_fits_validates():
    cfg = validate(
        load_config(
            None,
            [
                "data.mock=true",
                "model.vocab_size=64",
                "model.linear_backend=te",
                "model.fp8=hybrid",
                "model.fp8_recipe=delayed",
                "train.precision=bf16",
            ],
        ),
        1,
    )
    assert cfg.model.fp8 == "hybrid"


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


def test_mxfp8_needs_32_aligned_gemms():
    fp8 = ["model.linear_backend=te", "model.fp8=hybrid", "train.precision=bf16"]
    sizes = ["model.hidden_size=48", "model.num_attention_heads=3", "model.ffn_hidden_size=96"]
    base = ["data.mock=true", "model.vocab_size=64", "model.seq_length=64", *fp8, *sizes]
    validate(load_config(None, [*base, "model.fp8_recipe=tensorwise"]), 1)  # 16-aligned: fine
    with pytest.raises(ConfigError, match="model.hidden_size = 48 must be a multiple of 32"):
        validate(load_config(None, [*base, "model.fp8_recipe=mxfp8"]), 1)


def test_fp8_support_asks_te_and_names_a_missing_recipe(fake_te, monkeypatch):
    from megatron_lite.parallel import te_linear as backends

    assert backends.fp8_support("tensorwise") == (True, "")
    from transformer_engine.common import recipe

    monkeypatch.delattr(recipe, "MXFP8BlockScaling")
    ok, reason = backends.fp8_support("mxfp8")
    assert not ok and "no MXFP8BlockScaling recipe" in reason


def test_te_gemm_keeps_dtypes_train_mode_and_own_weight(fake_te):
    """Under bf16 autocast a TE layer with a bias gives the dtype F.linear gives (bf16 for a
    column-parallel layer; the row-parallel bias add after the reduction keeps fp32, as in the
    local backend); in fp32 the same numbers; eval() reaches the TE module, which computes
    with the layer's own weight."""
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    x = torch.randn(3, 2, 16)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        local, te = cls(16, 32, None, bias=True), cls(16, 32, None, bias=True, gemm="te")
        with torch.no_grad():
            for a, b in zip(local.parameters(), te.parameters(), strict=True):
                b.copy_(a.normal_())
        assert te._gemm.linear.weight is te.weight
        assert torch.allclose(te(x), local(x), atol=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = local(x), te(x)
        assert got.dtype == want.dtype, (cls, got.dtype, want.dtype)  # qkv/fc1 outputs: bf16
        assert cls is RowParallelLinear or got.dtype == torch.bfloat16
        te.eval()
        assert not te._gemm.linear.training
        te.train()
        assert te._gemm.linear.training
