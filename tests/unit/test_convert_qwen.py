"""tools/convert_checkpoint.py on Qwen3 dense (Qwen3ForCausalLM: q/k norms, head_dim != hidden /
heads, tied embeddings) and Qwen2-MoE (Qwen2MoeForCausalLM: q/k/v biases, a shared expert with
its sigmoid gate, a dense first layer, top-k weights not renormalized), against transformers'
own classes built offline: the round trip HF -> ours -> HF is bit-exact and loads in
transformers with every config field as it was; the config keys each family maps to (from the
published configs' fields); transformers' class defaults for missing fields; the errors for
what has no equivalent; and that the tiny models are sensitive enough for the parity bounds of
tests/parallel/test_convert_qwen.py (a shuffled expert, a wrong bias, a missing gate or q/k norm
moves the loss by far more than their 1e-5)."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tools.convert_checkpoint import dcp_to_hf, hf_to_dcp  # noqa: E402

VOCAB, SEQ = 128, 16
FAMILIES = ("qwen3", "qwen2_moe")


def qwen_hf_model(family: str, aux: float = 0.001):
    """A tiny random Qwen3 (2 layers, head_dim 32 with hidden 64 and 4 heads, 2 KV heads, tied
    embeddings) or Qwen2-MoE (layer 0 dense, layer 1: 8 experts top-2 not renormalized, a
    shared expert of width 48 and its gate, q/k/v biases), float32, eager attention. Weights
    O(0.2) (the routed experts' O(0.4)), norms in [0.5, 1.5], biases O(1) and
    the shared expert's gate O(0.3), so that
    every part moves the loss (test_tiny_models_are_sensitive)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=SEQ,
        attn_implementation="eager", experts_implementation="eager",  # float64 runs too
    )  # fmt: skip
    if family == "qwen3":
        config = Qwen3Config(
            intermediate_size=96, head_dim=32, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common,
        )  # fmt: skip
        cls = Qwen3ForCausalLM
    else:
        config = Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
            router_aux_loss_coef=aux, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, **common,
        )  # fmt: skip
        cls = Qwen2MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 1.0)
            elif "shared_expert_gate" in name:
                p.normal_(0.0, 0.3)
            elif ".experts." in name:  # the routed experts' share of the output matters
                p.normal_(0.0, 0.4)
            else:
                p.normal_(0.0, 0.2)
    return model


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))


def hf_loss(model, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy of `model` on ids [b, s + 1]."""
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact_and_loads_in_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = qwen_hf_model(family)
    model.save_pretrained(tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf2"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager")
    assert type(back) is type(model)
    a, b = model.state_dict(), back.state_dict()
    assert set(a) == set(b), f"{family}: names differ: {set(a) ^ set(b)}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{family}: {k} changed"
    head_dim = getattr(model.config, "head_dim", None) or 64 // 4
    assert getattr(back.config, "head_dim", None) in (None, head_dim)
    keys = ["num_key_value_heads", "intermediate_size", "rms_norm_eps"]
    keys += ["tie_word_embeddings", "rope_parameters", "num_hidden_layers", "vocab_size"]
    keys += ["layer_types", "use_sliding_window", "hidden_act", "attention_bias"]
    keys += ["moe_intermediate_size", "shared_expert_intermediate_size", "num_experts"]
    keys += ["num_experts_per_tok", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"]
    keys += ["qkv_bias"]
    for key in keys:
        want, got = getattr(model.config, key, None), getattr(back.config, key, None)
        assert got == want, f"{family}: config {key}={got!r}, want {want!r}"
    if family == "qwen2_moe":
        assert back.config.router_aux_loss_coef == pytest.approx(model.config.router_aux_loss_coef)
    ids = token_ids()
    # the tensors are bit-exact (above); the two models' losses agree to fp32 rounding only:
    # with several threads the GEMMs' reduction order follows the storages' alignment
    got, want = hf_loss(back, ids), hf_loss(model, ids)
    assert abs(got - want) <= 1e-6 * abs(want), f"reloaded model's loss {got} vs {want}"


# what hf-to-dcp makes of the published configs (fields as on the model cards: Qwen3-0.6B and
# Qwen1.5-MoE-A2.7B, sizes shrunk to match tiny weights; absent fields are absent there too)
PUBLISHED = {
    "qwen3": (
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
         "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
         "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
         "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
         "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
         "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False,
         "vocab_size": 151936},
        {"qk_layernorm": True, "kv_channels": 128, "num_query_groups": 8, "ffn_hidden_size": 3072,
         "tie_embeddings": True, "rope_theta": 1000000, "norm_eps": 1e-6, "num_layers": 28},
    ),
    "qwen2_moe": (
        {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
         "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 2048,
         "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
         "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
         "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
         "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
         "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
         "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
         "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001},
        {"num_experts": 60, "moe_router_topk": 4, "moe_ffn_hidden_size": 1408,
         "moe_shared_expert_ffn_hidden_size": 5632, "moe_shared_expert_gate": True,
         "add_qkv_bias": True, "moe_router_norm_topk": False, "moe_layer_freq": 1,
         "ffn_hidden_size": 5632, "kv_channels": None, "moe_aux_loss_coeff": 0.004,
         "qk_layernorm": False, "num_query_groups": 16},
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_published_config_maps_to_our_keys(family):
    from megatron_lite.config import ModelConfig
    from tools.hf_families import from_hf_config

    config, expected = PUBLISHED[family]
    ours = from_hf_config(config)
    defaults = ModelConfig()
    for key, want in expected.items():
        got = ours.get(key, getattr(defaults, key))
        assert got == pytest.approx(want), f"{family}: model.{key}={got!r}, want {want!r}"


def test_missing_fields_take_transformers_defaults():
    """HF_DEFAULTS (what a config.json without the field means) against transformers' classes."""
    from transformers import AutoConfig

    from tools.hf_checks import HF_DEFAULTS

    for family, defaults in HF_DEFAULTS.items():
        config = AutoConfig.for_model(family, hidden_size=512, num_attention_heads=16)
        for key, want in defaults.items():
            if key == "rope_theta":
                got = config.rope_parameters["rope_theta"]
            elif key == "head_dim":  # None: hidden / heads, in the attention or the config
                got = getattr(config, key, None)
                want = want or 512 // 16
                got = got or 512 // 16
            else:
                got = getattr(config, key, None)
            assert got == want, f"{family}: transformers' {key} default is {got!r}, ours {want!r}"
    # Qwen3's head_dim default (128) is not hidden/heads: a config without it is read so
    from tools.hf_families import from_hf_config

    config = dict(PUBLISHED["qwen3"][0])
    del config["head_dim"]
    assert from_hf_config({**config, "hidden_size": 2048})["kv_channels"] is None  # 2048/16
    assert from_hf_config({**config, "hidden_size": 512})["kv_channels"] == 128


REFUSED = [  # (family, config changes, what the error names)
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["sliding_attention"] * 28}, "layer_types"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ("qwen2_moe", {"qkv_bias": "yes"}, "qkv_bias='yes'"),
    ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
]


@pytest.mark.parametrize("family, change, needle", REFUSED)
def test_unrepresentable_hf_configs_are_errors(family, change, needle):
    from megatron_lite.checkpoint.errors import CheckpointError
    from tools.hf_families import from_hf_config

    config = {**PUBLISHED[family][0], **change}
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(")):
        from_hf_config(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_num_key_value_heads_is_required(family):
    """Their transformers classes' defaults are not one KV head per head (Qwen3's is 32,
    Qwen2-MoE's 16, Qwen3-MoE's 4, Mixtral's 8; Llama's is): a config.json without the field
    is refused, not guessed."""
    from transformers import AutoConfig

    from megatron_lite.checkpoint.errors import CheckpointError
    from tools.hf_families import from_hf_config

    assert AutoConfig.for_model(family, num_attention_heads=2).num_key_value_heads != 2
    without = {k: v for k, v in PUBLISHED[family][0].items() if k != "num_key_value_heads"}
    with pytest.raises(CheckpointError, match="has no num_key_value_heads"):
        from_hf_config(without)


EXPORT_REFUSED = [  # (our model.* keys over a Qwen2-MoE-like model, what the error names)
    ({"moe_shared_expert_gate": False}, "moe_shared_expert_gate=False"),
    ({"qk_layernorm": True}, "qk_layernorm=True"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "moe_router_num_groups"),
    ({"moe_shared_expert_ffn_hidden_size": 0, "moe_shared_expert_gate": False}, "add_qkv_bias"),
    ({"num_experts": None, "moe_shared_expert_ffn_hidden_size": 0}, "dense model"),
]


@pytest.mark.parametrize("change, needle", EXPORT_REFUSED)
def test_models_without_a_family_are_refused_on_export(change, needle):
    import dataclasses

    from megatron_lite.checkpoint.errors import CheckpointError
    from megatron_lite.config import ModelConfig
    from tools.hf_families import to_hf_config

    qwen2_moe = dict(
        num_experts=4, moe_shared_expert_ffn_hidden_size=32, moe_shared_expert_gate=True,
        add_qkv_bias=True, moe_layer_freq=[0, 1],
    )  # fmt: skip
    ours = dataclasses.asdict(ModelConfig(**qwen2_moe))
    assert to_hf_config(ours, 128)["architectures"] == ["Qwen2MoeForCausalLM"]
    with pytest.raises(CheckpointError, match=needle):
        to_hf_config({**ours, **change}, 128)


def _sensitivity(family: str) -> dict[str, float]:
    """The relative change of the loss when one part is broken the way a converter could."""
    model, ids = qwen_hf_model(family), token_ids()
    base = hf_loss(model, ids)
    broken = {}

    def moved(name: str, edit) -> None:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            edit(model)
        broken[name] = abs(hf_loss(model, ids) - base) / base
        model.load_state_dict(state)

    attns = [layer.self_attn for layer in model.model.layers]  # a converter slip hits them all

    def each(edit):
        return lambda m: [edit(a) for a in attns]

    # [2 KV heads · d, h]: the two KV heads swapped
    kv_swap = each(lambda a: a.k_proj.weight.copy_(a.k_proj.weight.roll(a.head_dim, 0)))
    moved("KV heads swapped", kv_swap)
    if family == "qwen3":
        moved("q/k norm weights dropped", each(lambda a: a.q_norm.weight.fill_(1.0)))
        moved("unchanged (control)", lambda m: m.model.embed_tokens.weight.mul_(1.0))
        return broken
    moved("q bias dropped", each(lambda a: a.q_proj.bias.zero_()))
    moved("k bias dropped", each(lambda a: a.k_proj.bias.zero_()))
    moved("v bias dropped", each(lambda a: a.v_proj.bias.zero_()))
    layer = model.model.layers[1]  # the MoE layer
    experts = layer.mlp.experts
    for p in (experts.gate_up_proj, experts.down_proj):  # expert e gets e + 1's matrix
        moved(f"experts shuffled ({list(p.shape)})", lambda m, p=p: p.copy_(p.roll(1, 0)))
    moved("shared expert gate missing", lambda m: layer.mlp.shared_expert_gate.weight.fill_(1e4))
    moved("top-k renormalized", lambda m: setattr(layer.mlp.gate, "norm_topk_prob", True))
    return broken


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_are_sensitive(family):
    """Each conversion mistake moves HF's own loss by far more than the parity bound (1e-5)."""
    broken = _sensitivity(family)
    print(family, {k: f"{v:.1e}" for k, v in broken.items()})
    control = broken.pop("unchanged (control)", None)
    assert control in (None, 0.0)
    for name, change in broken.items():
        # the top-2 of 8 renormalized only rescales the routed share: 50× the parity bound
        bound = 1e-4 if name == "top-k renormalized" else 1e-3
        assert change > bound, f"{family}: {name} moves the loss by only {change:.1e}"


def test_saved_qwen2_moe_config_names_every_field(tmp_path):
    """The exported config.json writes the fields whose class defaults would not fit a small
    model (num_key_value_heads, head_dim, the expert widths, qkv_bias)."""
    model = qwen_hf_model("qwen2_moe")
    model.save_pretrained(tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf2"))
    with open(tmp_path / "hf2" / "config.json") as f:
        written = json.load(f)
    keys = ["num_key_value_heads", "head_dim", "moe_intermediate_size", "qkv_bias"]
    keys += ["shared_expert_intermediate_size", "num_experts", "num_experts_per_tok"]
    for key in keys:
        assert key in written, f"the exported config.json has no {key}"
    assert written["num_key_value_heads"] == 2 and written["qkv_bias"] is True
