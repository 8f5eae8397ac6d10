"""Multi-head latent attention's and YaRN's config keys: the errors validation gives (each naming
the key and a fix, before any process group), the values the shipped configs resolve to, and
YaRN's RoPE frequencies, attention factor and MLA softmax scale against Hugging Face
transformers 5.25's own functions (`_compute_yarn_parameters`, `yarn_apply_mscale`)."""

import math
import os

import pytest
import torch

from megatron_lite.config import ConfigError, load_config
from megatron_lite.models import rope_scaling
from megatron_lite.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")  # mock data, vocab 512, 2 layers, 4 heads
MLA = ["model.multi_latent_attention=true", "model.num_query_groups=4", "model.q_lora_rank=32",
       "model.kv_lora_rank=16",
       "model.qk_head_dim=12", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=10"]  # fmt: skip
YARN = "{type: yarn, factor: 40, original_max_position_embeddings: 16}"

# (case id, world size, overrides of smoke.yaml, needle)
ERRORS = [
    ("sizes-without-flag", 1, ["model.kv_lora_rank=64"], "model.kv_lora_rank=64: sizes multi"),
    ("q-lora-without-flag", 1, ["model.q_lora_rank=64"], "model.q_lora_rank=64: sizes multi"),
    ("odd-rope", 1, [*MLA, "model.qk_pos_emb_head_dim=7"], "model.qk_pos_emb_head_dim=7: RoPE"),
    ("zero-v", 1, [*MLA, "model.v_head_dim=0"], "model.v_head_dim=0: must be >= 1"),
    ("zero-q-lora", 1, [*MLA, "model.q_lora_rank=0"], "model.q_lora_rank=0: must be >= 1"),
    ("query-groups", 1, [*MLA, "model.num_query_groups=2"], "model.num_query_groups=2: multi"),
    ("kv-channels", 1, [*MLA, "model.kv_channels=16"], "model.kv_channels=16: MLA's head"),
    ("qk-layernorm", 1, [*MLA, "model.qk_layernorm=true"], "model.qk_layernorm=True: MLA"),
    ("heads-over-tp", 8, [*MLA, "parallel.tp=8"], "parallel.tp=8: model.num_attention_heads=4"),
    ("gpt", 1, [*MLA, "model.arch=gpt"], "model.multi_latent_attention=True: model.arch=gpt"),
    ("fp8-widths", 1, [*MLA, "model.fp8=hybrid", "model.linear_backend=te",
                       "train.precision=bf16", "model.seq_length=64"], "model.fp8='hybrid'"),
    ("yarn-type", 1, ["model.rope_scaling={type: linear, factor: 4}"], "only yarn scaling"),
    ("yarn-factor", 1, ["model.rope_scaling={type: yarn, original_max_position_embeddings: 4}"],
     "needs factor"),
    ("yarn-original", 1, ["model.rope_scaling={type: yarn, factor: 4}"],
     "needs original_max_position_embeddings"),
    ("yarn-unknown", 1, [f"model.rope_scaling={YARN[:-1]}, msacle: 1}}"],
     "unknown keys ['msacle']"),
    ("yarn-shrink", 1, ["model.rope_scaling={type: yarn, factor: 0.5, "
                        "original_max_position_embeddings: 4}"], "factor=0.5 must be >= 1"),
    ("yarn-string", 1, ["model.rope_scaling={type: yarn, factor: forty, "
                        "original_max_position_embeddings: 4}"], "factor='forty' must be a number"),
]  # fmt: skip


@pytest.mark.parametrize("case, world, overrides, needle", ERRORS, ids=[c[0] for c in ERRORS])
def test_bad_mla_key_is_refused_naming_it(case, world, overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(load_config(SMOKE, overrides), world, warn=False)
    message = str(e.value)
    assert needle in message, message
    assert "Fix:" in message, message


def test_mla_and_yarn_configs_validate():
    validate(load_config(SMOKE, [*MLA, f"model.rope_scaling={YARN}"]), 1, warn=False)
    validate(load_config(SMOKE, [*MLA, "model.q_lora_rank=null", "parallel.tp=2",
                                 "parallel.sequence_parallel=true"]), 2, warn=False)  # fmt: skip
    cfg = load_config(SMOKE, [f"model.rope_scaling={YARN}"])  # plain llama with YaRN tables
    assert validate(cfg, 1, warn=False).model.rope_scaling["factor"] == 40


def test_rope_scaling_must_be_a_mapping():
    with pytest.raises(ConfigError, match="model.rope_scaling=40: expected a mapping"):
        load_config(SMOKE, ["model.rope_scaling=40"])


def _hf_yarn(dim, theta, scaling):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters, yarn_apply_mscale

    rope = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn",
            "rope_theta": theta}  # fmt: skip
    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=dim, rope_parameters=rope
    )
    inv_freq, factor = _compute_yarn_parameters(config)
    return inv_freq, factor, yarn_apply_mscale(config.rope_parameters, 1.0)


@pytest.mark.parametrize(
    "dim, theta, scaling",
    [
        (64, 10000.0, {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
        (8, 100.0, {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64,
                    "mscale": 1, "mscale_all_dim": 0}),
        (16, 500.0, {"type": "yarn", "factor": 8, "original_max_position_embeddings": 256,
                     "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0}),
        (32, 10000.0, {"type": "yarn", "factor": 4, "original_max_position_embeddings": 2048,
                       "truncate": False}),
    ],
    ids=["deepseek-v3", "no-mscale-all-dim", "betas-and-mscale", "untruncated"],
)  # fmt: skip
def test_yarn_matches_hf(dim, theta, scaling):
    """Our float64 YaRN against HF's float32 one: frequencies to float32 rounding, the attention
    factor and the softmax scale's mscale² exactly as HF computes them (DeepSeek-V3's: 1 and
    (0.1·ln 40 + 1)²)."""
    pytest.importorskip("transformers")
    hf_inv_freq, hf_factor, hf_mscale2 = _hf_yarn(dim, theta, scaling)
    ours = rope_scaling.inv_freq(dim, theta, scaling)
    torch.testing.assert_close(ours.float(), hf_inv_freq, rtol=2e-7, atol=0)
    assert rope_scaling.attention_factor(scaling) == pytest.approx(hf_factor, rel=1e-15)
    assert rope_scaling.softmax_scale_factor(scaling) == pytest.approx(hf_mscale2, rel=1e-15)
    plain = rope_scaling.inv_freq(dim, theta, None)
    assert (ours - plain).abs().max() > 1e-3 * plain.max(), "YaRN left the frequencies as they were"
    if scaling.get("mscale_all_dim") == 1.0 and scaling.get("mscale") == 1.0:  # DeepSeek-V3's
        assert hf_factor == 1.0
        assert hf_mscale2 == pytest.approx((0.1 * math.log(scaling["factor"]) + 1) ** 2)
