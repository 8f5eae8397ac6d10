"""tools/convert_checkpoint.py on DeepSeek-V3 (DeepseekV3ForCausalLM: MLA with q_lora_rank, YaRN,
interleaved RoPE, one dense layer then MoE with sigmoid group routing, the selection bias,
shared experts, the routed scaling factor, the MTP module as layer N, FP8 weights), against
transformers' own classes built offline: the round trip HF -> ours -> HF is bit-exact (the MTP
layer's tensors included) and loads in transformers; the published config's fields map to our
keys; transformers' class defaults for missing fields (tests/unit/test_convert_qwen.py checks
HF_DEFAULTS for every family); what has no equivalent is an error naming the field; FP8 blocks
are dequantized as DeepSeek's fp8_cast_bf16.py does; and the tiny model is sensitive enough for
the parity bounds of tests/parallel/test_convert_deepseek.py."""

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from tests.unit.test_convert_qwen import VOCAB, hf_loss, token_ids  # noqa: E402
from tools.convert_checkpoint import dcp_to_hf, hf_to_dcp  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40, "mscale": 1.0}
YARN |= {"mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
YARN |= {"beta_fast": 32, "beta_slow": 1}  # the published config's rope_scaling


def deepseek_hf_model(q_lora_rank: int | None = 24, tied: bool = False, groups: int = 2):
    """A tiny random DeepSeek-V3: 2 layers (layer 0 dense, layer 1 MoE), hidden 64, 4 heads of
    q/k 8 + 4 (RoPE) and v 12, q_lora_rank 24, kv_lora_rank 16, the published YaRN; 8 experts
    of width 16 in 2 groups, top-3 within 1 group scored by its top 2, 2 shared experts, scaling
    2.5, the selection bias drawn O(0.1); float32, eager (q_lora_rank None: one q_proj; tied:
    tied embeddings; groups 1: no group limit). Weights O(0.2) (experts O(0.4)),
    norms in [0.5, 1.5], so every part moves the loss (test_tiny_model_is_sensitive)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=3, n_group=groups, topk_group=1,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_parameters=dict(YARN), tie_word_embeddings=tied,
        attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts." in name:  # routed and shared: their share of the output matters
                p.normal_(0.0, 0.4)
            else:
                p.normal_(0.0, 0.2)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def mtp_tensors(model, seed: int = 2) -> dict[str, torch.Tensor]:
    """Layer N (num_hidden_layers) as the published checkpoints hold it: an MoE decoder layer's
    tensors (drawn as the model's), enorm, hnorm, eh_proj, shared_head.norm, and the copies of
    the embedding and output head (shared_head.head)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    n, h = model.config.num_hidden_layers, model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    layer = DeepseekV3DecoderLayer(model.config, layer_idx=n)
    out = {}
    for name, p in [*layer.named_parameters(), *layer.named_buffers()]:
        if "norm" in name:
            t = torch.rand(p.shape, generator=g) + 0.5
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(p.shape, generator=g) * 0.1
        else:
            t = torch.randn(p.shape, generator=g) * (0.4 if ".experts." in name else 0.2)
        if name.startswith("mlp.experts.") and name.endswith(("gate_up_proj", "down_proj")):
            f = model.config.moe_intermediate_size
            for e in range(t.shape[0]):  # the per-expert names of the files
                if name.endswith("gate_up_proj"):
                    out[f"mlp.experts.{e}.gate_proj.weight"] = t[e, :f].clone()
                    out[f"mlp.experts.{e}.up_proj.weight"] = t[e, f:].clone()
                else:
                    out[f"mlp.experts.{e}.down_proj.weight"] = t[e].clone()
            continue
        out[name] = t
    out |= {
        "enorm.weight": torch.rand(h, generator=g) + 0.5,
        "hnorm.weight": torch.rand(h, generator=g) + 0.5,
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.2,
        "shared_head.norm.weight": torch.rand(h, generator=g) + 0.5,
        "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
        "shared_head.head.weight": model.lm_head.weight.detach().clone(),
    }
    return {f"model.layers.{n}.{k}": v.contiguous() for k, v in out.items()}


def save_with_mtp(model, path) -> dict[str, torch.Tensor]:
    """save_pretrained plus layer N in a second file (as the published shards): its tensors."""
    from safetensors.torch import save_file

    model.save_pretrained(path)
    extra = mtp_tensors(model)
    save_file(extra, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    return extra


def read_dir(path) -> dict[str, torch.Tensor]:
    from tools.convert_inputs import read_hf_tensors

    return read_hf_tensors(str(path))[0]


VARIANTS = {  # name: deepseek_hf_model's arguments
    "q_lora": {},
    "no_q_lora_tied_no_groups": {"q_lora_rank": None, "tied": True, "groups": 1},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact_with_the_mtp_layer_and_loads_in_transformers(variant, tmp_path):
    from transformers import AutoModelForCausalLM

    model = deepseek_hf_model(**VARIANTS[variant])
    save_with_mtp(model, tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    with open(tmp_path / "ckpt" / "metadata.json") as f:
        ours = json.load(f)["config"]["model"]
    assert ours["mtp_num_layers"] == 1 and ours["moe_router_enable_expert_bias"] is True
    dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf2"))
    a, b = read_dir(tmp_path / "hf"), read_dir(tmp_path / "hf2")
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))[:6]}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k} changed"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager")
    assert type(back) is type(model)
    for key in ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"]:
        want, got = getattr(model.config, key), getattr(back.config, key)
        assert got == want, f"config {key}={got!r}, want {want!r}"
    keys = ["v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok"]
    keys += ["n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "qk_head_dim"]
    keys += ["routed_scaling_factor", "rope_parameters", "rope_interleave", "rms_norm_eps"]
    keys += ["num_key_value_heads", "moe_intermediate_size", "intermediate_size"]
    keys += ["tie_word_embeddings", "num_nextn_predict_layers", "vocab_size"]
    for key in keys:
        want, got = getattr(model.config, key), getattr(back.config, key)
        assert got == want, f"config {key}={got!r}, want {want!r}"
    ids = token_ids()
    # the tensors are bit-exact (above); the two models' losses agree to fp32 rounding only:
    # with several threads the GEMMs' reduction order follows the storages' alignment
    got, want = hf_loss(back, ids), hf_loss(model, ids)
    assert abs(got - want) <= 1e-6 * abs(want), f"reloaded model's loss {got} vs {want}"


def test_bf16_export_keeps_the_selection_bias_in_fp32(tmp_path):
    model = deepseek_hf_model()
    model.save_pretrained(tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf2"), dtype=torch.bfloat16)
    written = read_dir(tmp_path / "hf2")
    bias = written.pop("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.dtype == torch.float32
    assert torch.equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
    assert {t.dtype for t in written.values()} == {torch.bfloat16}


def test_mtp_layer_lands_in_our_mtp_module(tmp_path):
    """Layer N's tensors are module 1 of our MTP, named as models/mtp.py's docstring maps them."""
    from tools.convert_checkpoint import read_model

    model = deepseek_hf_model()
    extra = save_with_mtp(model, tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    _, ours = read_model(str(tmp_path / "ckpt"))
    n, f = 2, 16
    pairs = {
        "mtp.layers.0.enorm.weight": "enorm.weight",
        "mtp.layers.0.eh_proj.weight": "eh_proj.weight",
        "mtp.layers.0.final_norm.weight": "shared_head.norm.weight",
        "mtp.layers.0.layer.self_attention.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
        "mtp.layers.0.layer.mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
        "mtp.layers.0.layer.pre_mlp_norm.weight": "post_attention_layernorm.weight",
    }
    for mine, theirs in pairs.items():
        assert torch.equal(ours[mine], extra[f"model.layers.{n}.{theirs}"]), mine
    w1 = ours["mtp.layers.0.layer.mlp.experts.weight1"]  # [E, 2f, h]: [gate; up]
    assert torch.equal(w1[5, f:], extra[f"model.layers.{n}.mlp.experts.5.up_proj.weight"])
    assert not any("embed_tokens" in k or "shared_head" in k for k in ours)


def test_mtp_is_dropped_with_no_mtp_or_when_transformers_dropped_it(tmp_path, capsys):
    model = deepseek_hf_model()
    save_with_mtp(model, tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "a"), mtp=False)
    assert "dropped the MTP module" in capsys.readouterr().err
    model.save_pretrained(tmp_path / "plain")  # num_nextn_predict_layers 1, no layer 2
    hf_to_dcp(str(tmp_path / "plain"), str(tmp_path / "b"))
    assert "weights hold no layer 2" in capsys.readouterr().err
    for out in ("a", "b"):
        with open(tmp_path / out / "metadata.json") as f:
            assert json.load(f)["config"]["model"]["mtp_num_layers"] == 0


def test_fp8_blocks_are_dequantized(tmp_path):
    """float8_e4m3fn weights with a weight_scale_inv per 8×8 block (shapes not multiples of the
    block), as the published files hold them at 128×128: each block times its scale."""
    from safetensors.torch import load_file, save_file

    from tools.convert_checkpoint import read_model

    model = deepseek_hf_model()
    model.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # [4·(8 + 12), 16] = [80, 16]
    w = tensors[name]
    scale = torch.rand(10, 2) + 0.01  # ceil(80/8) × ceil(16/8)
    fp8 = w.to(torch.float8_e4m3fn)  # stored values; the weight is fp8 · scale
    tensors[name] = fp8
    tensors[name.replace(".weight", ".weight_scale_inv")] = scale
    save_file(tensors, file, metadata={"format": "pt"})
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(config, f)
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    got = read_model(str(tmp_path / "ckpt"))[1]["layers.0.self_attention.kv_b_proj.weight"]
    want = torch.empty(80, 16)
    for i in range(80):  # the reference, element by element
        for j in range(16):
            want[i, j] = fp8[i, j].float() * scale[i // 8, j // 8]
    assert torch.equal(got, want)
    del config["quantization_config"]
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(config, f)
    from megatron_lite.checkpoint.errors import CheckpointError

    with pytest.raises(CheckpointError, match="quantization_config"):
        hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt2"))


# the published DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), as on the model card
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0,
    "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
EXPECTED = {
    "multi_latent_attention": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "num_experts": 256,
    "moe_ffn_hidden_size": 2048, "moe_shared_expert_ffn_hidden_size": 2048,
    "moe_first_k_dense_replace": 3, "moe_router_topk": 8, "moe_router_score_function": "sigmoid",
    "moe_router_norm_topk": True, "moe_router_topk_scaling_factor": 2.5,
    "moe_router_enable_expert_bias": True, "moe_router_num_groups": 8,
    "moe_router_group_topk": 4, "moe_router_group_score": "top2", "moe_aux_loss_coeff": 0.001,
    "moe_aux_loss_type": "seq", "mtp_num_layers": 1, "num_layers": 61, "hidden_size": 7168,
    "ffn_hidden_size": 18432, "num_attention_heads": 128, "norm_eps": 1e-6,
    "tie_embeddings": False, "rope_theta": 10000, "kv_channels": None,
    "rope_scaling": {"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1},
}  # fmt: skip


def test_published_config_maps_to_our_keys_and_validates():
    from megatron_lite.config import Config, ModelConfig
    from megatron_lite.validation import validate
    from tools.hf_families import from_hf_config

    ours = from_hf_config(PUBLISHED)
    defaults = ModelConfig()
    for key, want in EXPECTED.items():
        got = ours.get(key, getattr(defaults, key))
        assert got == want, f"model.{key}={got!r}, want {want!r}"
    cfg = Config()
    cfg.model = ModelConfig(**{**ours, "seq_length": 4096})
    cfg.data.mock = True
    validate(cfg, 1)  # our config rules accept it as it is


REFUSED = [  # (config changes, what the error names)
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"num_key_value_heads": 8}, "num_key_value_heads=8"),
    ({"n_group": 3}, "n_group=3"),
    ({"n_group": 256, "topk_group": 8}, "n_group=256"),  # groups of one: no top-2 score
    ({"topk_group": 9}, "topk_group=9"),
    ({"first_k_dense_replace": 61}, "first_k_dense_replace=61"),
    ({"qk_head_dim": 128}, "qk_head_dim=128"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type linear"),
    ({"rope_scaling": {**PUBLISHED["rope_scaling"], "low_freq_factor": 1}}, "low_freq_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"n_shared_experts": 0}, "n_shared_experts=0"),
]


@pytest.mark.parametrize("change, needle", REFUSED)
def test_unrepresentable_configs_are_errors(change, needle):
    from megatron_lite.checkpoint.errors import CheckpointError
    from tools.hf_families import from_hf_config

    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(")):
        from_hf_config({**PUBLISHED, **change})


def test_more_than_one_mtp_module_is_refused_unless_dropped():
    from megatron_lite.checkpoint.errors import CheckpointError
    from tools.hf_deepseek import settle_mtp
    from tools.hf_families import from_hf_config

    m = from_hf_config({**PUBLISHED, "num_nextn_predict_layers": 2})
    hf = {"model.layers.61.enorm.weight": torch.ones(1), "model.layers.62.enorm.weight": None}
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=2.*--no-mtp"):
        settle_mtp(m, hf)
    m, kept, notes = settle_mtp(m, hf, keep=False)
    assert m["mtp_num_layers"] == 0 and kept == {} and "dropped" in notes[0]


def _ours(**change) -> dict:
    import dataclasses

    from megatron_lite.config import ModelConfig
    from tools.hf_families import from_hf_config

    m = {**from_hf_config(PUBLISHED), **change}
    return dataclasses.asdict(ModelConfig(**m))


EXPORT_REFUSED = [
    ({"moe_router_score_function": "softmax"}, "moe_router_score_function"),
    ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
    ({"moe_shared_expert_ffn_hidden_size": 3000}, "moe_shared_expert_ffn_hidden_size=3000"),
    ({"mtp_num_layers": 2}, "mtp_num_layers=2"),
    ({"moe_router_group_score": "topk_per_group", "moe_router_topk": 6}, "group_score"),
    ({"moe_layer_freq": [0, 1] * 30 + [1]}, "moe_layer_freq"),
    ({"num_experts": None}, "dense model"),
    ({"moe_aux_loss_type": "global"}, "moe_aux_loss_type=global"),
]


@pytest.mark.parametrize("change, needle", EXPORT_REFUSED)
def test_models_deepseek_cannot_hold_are_refused_on_export(change, needle):
    from megatron_lite.checkpoint.errors import CheckpointError
    from tools.hf_families import to_hf_config

    assert to_hf_config(_ours(), 129280)["architectures"] == ["DeepseekV3ForCausalLM"]
    with pytest.raises(CheckpointError, match=needle):
        to_hf_config(_ours(**change), 129280)


def test_export_writes_the_published_fields():
    """Our config of the published model exports the published config.json's fields back."""
    from tools.hf_families import to_hf_config

    written = to_hf_config(_ours(), 129280)
    skip = {"rope_scaling", "rope_theta", "quantization_config", "torch_dtype", "ep_size"}
    skip |= {"bos_token_id", "eos_token_id"}
    for key, want in PUBLISHED.items():
        if key not in skip:
            assert written.get(key) == want, f"{key}: {written.get(key)!r}, want {want!r}"
    rope = {**PUBLISHED["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000}
    del rope["type"]
    assert written["rope_parameters"] == rope


def _sensitivity() -> dict[str, float]:
    """The relative change of HF's loss when one part is broken the way a converter could."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    model, ids = deepseek_hf_model(), token_ids()
    base = hf_loss(model, ids)
    broken = {}

    def moved(name: str, edit, undo=None) -> None:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            edit(model)
        broken[name] = abs(hf_loss(model, ids) - base) / base
        model.load_state_dict(state)
        if undo:
            undo(model)

    attns = [layer.self_attn for layer in model.model.layers]
    moe = model.model.layers[1].mlp
    for p in (moe.experts.gate_up_proj, moe.experts.down_proj):  # expert e gets e + 1's
        moved(f"experts shuffled ({list(p.shape)})", lambda m, p=p: p.copy_(p.roll(1, 0)))
    moved("expert bias dropped", lambda m: moe.gate.e_score_correction_bias.zero_())
    moved("shared experts dropped", lambda m: moe.shared_experts.down_proj.weight.zero_())
    moved("scaling factor dropped", lambda m: setattr(moe.gate, "routed_scaling_factor", 1.0))
    moved("no group limit", lambda m: setattr(moe.gate, "topk_group", 2))
    scale = attns[0].scaling
    moved(
        "softmax scale without YaRN's mscale²",
        lambda m: [setattr(a, "scaling", a.qk_head_dim**-0.5) for a in attns],
        lambda m: [setattr(a, "scaling", scale) for a in attns],
    )
    moved(
        "RoPE not interleaved",
        lambda m: setattr(m.config, "rope_interleave", False),
        lambda m: setattr(m.config, "rope_interleave", True),
    )

    def swap_rope_split(m):  # the RoPE dims taken first in each q head (a wrong split)
        for a in attns:
            w = a.q_b_proj.weight.view(4, 12, -1)
            w.copy_(torch.cat([w[:, 8:], w[:, :8]], dim=1))

    moved("q's nope/rope split swapped", swap_rope_split)
    assert hf.DeepseekV3Attention is type(attns[0])
    return broken


def test_tiny_model_is_sensitive():
    """Each conversion mistake moves HF's own loss by far more than the parity bound (1e-5)."""
    broken = _sensitivity()
    print({k: f"{v:.1e}" for k, v in broken.items()})
    for name, change in broken.items():
        assert change > 1e-3, f"{name} moves the loss by only {change:.1e}"
