"""The architecture registry's contract (models/registry.py): `model.arch` takes exactly the
registered names and says which they are; what an entry declares reaches validation, resolve,
the warnings and the converter; validation reads the entries without loading the layers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_lite.config import ConfigError, ModelConfig, load_config
from megatron_lite.models.registry import (
    ArchitectureSpec,
    FlopsPerToken,
    architecture_names,
    get_architecture,
    hf_architecture,
    register_architecture,
    unregister_architecture,
)
from megatron_lite.resolve import ffn_hidden_size
from megatron_lite.validation import config_warnings, validate

MOCK = ["data.mock=true", "model.vocab_size=64"]


def _no_flops(m, vocab_size: int) -> FlopsPerToken:
    return FlopsPerToken(0.0, 0.0)


@pytest.fixture
def dense_only():
    """A registered toy without an MoE part, with a rule of its own and a key it never reads;
    removed after the test."""

    def even_layers(cfg):
        if cfg.model.num_layers % 2:
            raise ConfigError(f"model.num_layers={cfg.model.num_layers}: must be even. Fix: x.")

    spec = ArchitectureSpec(
        name="dense_only",
        attention="megatron_lite.models.transformer:Attention",
        mlp="megatron_lite.models.transformer:build_dense_mlp",
        norm="megatron_lite.parallel.norms:LayerNorm",
        ffn_hidden_size=lambda h: 5 * h,
        flops=_no_flops,
        validate=even_layers,
        unused_keys=(("rope_theta", "dense_only has no RoPE", "remove it"),),
    )
    register_architecture(spec)
    yield spec
    unregister_architecture("dense_only")


def test_unknown_arch_names_the_key_the_value_and_every_registered_name(dense_only):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*MOCK, "model.arch=mla_someday"]), 1, warn=False)
    msg = str(e.value)
    names = architecture_names()  # other test modules may have registered toys too
    assert names[:2] == ("llama", "gpt") and "dense_only" in names, names
    assert msg.startswith(f"model.arch='mla_someday': must be one of {', '.join(names)} "), msg
    assert "register_architecture" in msg, msg
    with pytest.raises(
        ValueError, match=r"model.arch='bert'.*\(registered: llama, gpt, .*dense_only"
    ):
        get_architecture("bert")


def test_a_registered_name_is_accepted_and_its_declarations_are_read(dense_only):
    cfg = validate(load_config(None, [*MOCK, "model.arch=dense_only"]), 1, warn=False)
    assert cfg.model.ffn_hidden_size == 5 * 64  # the entry's default width
    with pytest.raises(ConfigError, match=r"model.num_layers=3: must be even"):
        validate(load_config(None, [*MOCK, "model.arch=dense_only", "model.num_layers=3"]), 1)
    warned = config_warnings(load_config(None, [*MOCK, "model.arch=dense_only",
                                                "model.rope_theta=5e5"]))  # fmt: skip
    assert warned == ["model.rope_theta=500000.0 has no effect: dense_only has no RoPE. Fix: "
                      "remove it."], warned  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.num_experts=4: model.arch=dense_only has no "
                                          r"MoE part.*\(llama, gpt"):  # fmt: skip
        validate(load_config(None, [*MOCK, "model.arch=dense_only", "model.num_experts=4"]), 1)


def test_a_name_is_registered_once(dense_only):
    with pytest.raises(ValueError, match="'dense_only' is already registered"):
        register_architecture(dense_only)
    assert architecture_names()[:2] == ("llama", "gpt")


def test_shipped_entries_keep_their_defaults():
    """The MLP widths resolve gave before the registry (Llama's 8h/3 to a multiple of 64, GPT's
    4h), the rotary rule on llama only, HF families on llama only."""
    # 8·4096/3 = 10922.7 -> the next multiple of 64 (Llama 2 rounds to 256: 11008)
    assert ffn_hidden_size(ModelConfig(arch="llama", hidden_size=4096)) == 10944
    assert ffn_hidden_size(ModelConfig(arch="gpt", hidden_size=768)) == 3072  # GPT-2 small
    odd = [*MOCK, "model.hidden_size=60", "model.num_attention_heads=4"]  # head dim 15
    with pytest.raises(ConfigError, match="rotary embeddings need an even head dim"):
        validate(load_config(None, [*odd, "model.arch=llama"]), 1, warn=False)
    validate(load_config(None, [*odd, "model.arch=gpt"]), 1, warn=False)
    assert hf_architecture("mixtral") == "llama" and hf_architecture("gpt2") is None
    assert get_architecture("gpt").hf_families == ()


def test_parts_by_name_load_on_first_use():
    from types import SimpleNamespace

    from megatron_lite.models.mla import LLAMA_ATTENTION, MLASelfAttention
    from megatron_lite.models.transformer import Attention, RotaryAttention

    # llama's attention: RotaryAttention, or MLA with model.multi_latent_attention
    assert get_architecture("llama").part("attention") is LLAMA_ATTENTION
    assert LLAMA_ATTENTION.pick(SimpleNamespace(multi_latent_attention=False)) is RotaryAttention
    assert LLAMA_ATTENTION.pick(SimpleNamespace(multi_latent_attention=True)) is MLASelfAttention
    assert get_architecture("gpt").part("attention") is Attention
    with pytest.raises(ValueError, match="'gpt' has no layer_norm part|not one of"):
        get_architecture("gpt").part("layer_norm")


def test_validation_reads_the_registry_without_loading_the_layers():
    """Every CLI process validates: the entries must not pull in the layers (and with them
    DTensor and the kernels, ~1 s a process)."""
    code = (
        "import sys, megatron_lite.validation\n"
        "from megatron_lite.models.registry import architecture_names\n"
        "loaded = [m for m in ('megatron_lite.models.transformer', 'megatron_lite.kernels',\n"
        "          'megatron_lite.parallel.params') if m in sys.modules]\n"
        "print(architecture_names(), loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('llama', 'gpt') []", out.stdout
