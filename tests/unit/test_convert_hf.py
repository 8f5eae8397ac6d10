"""tools/convert_checkpoint.py against transformers' LlamaForCausalLM (built locally, no
download): an exact round trip HF -> ours -> HF, and logits of our model (one rank, float32)
equal to HF's within 1e-4 in both directions, so the RoPE, GQA and SwiGLU conventions agree.
Mixtral and Qwen3-MoE: exact round trips, the config keys they map to, and the errors for what
has no equivalent (their logits on several layouts: tests/parallel/test_convert_moe.py)."""

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tests.dist_harness import run_ranks  # noqa: E402
from tools.convert_checkpoint import dcp_to_hf, hf_to_dcp  # noqa: E402

VOCAB, SEQ = 250, 16
OURS = [
    "model.arch=llama",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    f"model.vocab_size={VOCAB}",
    f"model.seq_length={SEQ}",
    "model.norm_eps=1e-5",
    "model.rope_theta=5000.0",
    "model.make_vocab_size_divisible_by=128",  # 250 -> 256: padding rows dropped / zeroed
    "data.mock=true",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "log.progress=false",
]


def hf_model(tie: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # O(1) logits, norms away from 1, so a convention slip shows
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _our_logits(rank, world, overrides, out_dir, ids, train):
    """Build the Trainer (loading train.init_from if set), optionally train train.steps, and
    return the float32 logits [b, s, V] of its model for `ids`."""
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    if train:
        trainer.train()
    chunk = trainer.chunks[0]
    with torch.no_grad():
        x = chunk.embed(ids)  # [s, b, h]
        for layer in chunk.layers.values():
            x = layer(x, chunk.token_context())
        logits = chunk.output_layer(chunk.final_norm(x), chunk.output_weight())  # [s, b, Vp]
    return logits[..., :VOCAB].transpose(0, 1).numpy()  # numpy: a tensor can't cross the queue


def assert_logits_close(ranks_out, hf, what):
    ours = torch.from_numpy(ranks_out[0])
    diff = (ours - hf).abs().max().item()
    scale = hf.abs().max().item()
    print(f"LOGITS {what}: max abs diff {diff:.2e} (max |logit| {scale:.2f})")
    assert scale > 1.0, "logits too small to test anything"
    assert diff < 1e-4, f"{what}: our logits differ from HF Llama's by {diff:.2e}"


def test_round_trip_is_exact(tmp_path):
    model = hf_model(tie=False)
    model.save_pretrained(tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf2"))
    back = LlamaForCausalLM.from_pretrained(tmp_path / "hf2")
    a, b = model.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} changed in the round trip"
    keys = ("num_key_value_heads", "intermediate_size", "rms_norm_eps", "tie_word_embeddings")
    for key in (*keys, "rope_theta", "rope_parameters"):  # rope_* differ by transformers version
        assert getattr(back.config, key, None) == getattr(model.config, key, None), key


@pytest.mark.parametrize("tie", [False, True])
def test_hf_weights_start_training_with_hf_logits(tie, tmp_path):
    model = hf_model(tie)
    model.save_pretrained(tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    ids = token_ids()
    overrides = [*OURS, f"model.tie_embeddings={str(tie).lower()}"]
    overrides.append(f"train.init_from={tmp_path / 'ckpt'}")
    ours = run_ranks(1, _our_logits, overrides, str(tmp_path / "run"), ids, False, timeout=120)
    with torch.no_grad():
        hf = model(ids).logits
    assert_logits_close(ours, hf, f"hf->ours tie={tie}")


def test_trained_model_loads_in_transformers(tmp_path):
    out = str(tmp_path / "run")
    overrides = [*OURS, "train.steps=3", "train.save_interval=3", "model.init_method_std=0.1"]
    ids = token_ids()
    ours = run_ranks(1, _our_logits, overrides, out, ids, True, timeout=120)
    dcp_to_hf(os.path.join(out, "checkpoints"), str(tmp_path / "hf"))
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    with torch.no_grad():
        hf = model.float().eval()(ids).logits
    assert_logits_close(ours, hf, "ours->hf")


# ------------------------------------------------------------------ mixture of experts
def moe_hf_model(family: str):
    """A tiny random Mixtral (every layer MoE, renormalized top-2) or Qwen3-MoE (q/k norms,
    head_dim 32 != hidden/heads, layer 0 dense through mlp_only_layers, top-2 not
    renormalized), weights O(0.1) and norms away from 1."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=SEQ,
        tie_word_embeddings=False, num_experts_per_tok=2, router_aux_loss_coef=0.001,
        attn_implementation="eager",
    )  # fmt: skip
    if family == "mixtral":
        config = MixtralConfig(intermediate_size=32, num_local_experts=8, **common)
        cls = MixtralForCausalLM
    else:
        config = Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=32,
            mlp_only_layers=[0], norm_topk_prob=False, **common,
        )  # fmt: skip
        cls = Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


# what hf-to-dcp must make of each family's config (the independent half of the mapping)
EXPECTED_MOE_KEYS = {
    "mixtral": {
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
        "moe_router_norm_topk": True, "kv_channels": None, "moe_aux_loss_coeff": 0.002,
    },
    "qwen3_moe": {
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "ffn_hidden_size": 96,
        "moe_router_norm_topk": False, "kv_channels": 32, "qk_layernorm": True,
        "moe_layer_freq": [0, 1], "moe_aux_loss_coeff": 0.002,
    },
}  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_round_trip_is_exact(family, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    model = moe_hf_model(family)
    model.save_pretrained(tmp_path / "hf")
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    with open(tmp_path / "ckpt" / "metadata.json") as f:
        ours = json.load(f)["config"]["model"]
    for key, want in EXPECTED_MOE_KEYS[family].items():
        assert ours[key] == pytest.approx(want), f"{family}: model.{key}={ours[key]}, want {want}"
    dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf2"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    assert type(back) is type(model)
    a, b = model.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{family}: {k} changed in the round trip"
    head_dim = 64 // 4 if family == "mixtral" else 32  # Mixtral's null = hidden / heads
    assert back.config.head_dim == head_dim
    keys = ["num_experts_per_tok", "intermediate_size", "num_key_value_heads"]
    keys += ["mlp_only_layers", "norm_topk_prob", "moe_intermediate_size", "num_experts"]
    keys += ["num_local_experts", "decoder_sparse_step", "rope_theta", "rope_parameters"]
    for key in keys:
        assert getattr(back.config, key, None) == getattr(model.config, key, None), key
    assert back.config.router_aux_loss_coef == pytest.approx(model.config.router_aux_loss_coef)


def test_moe_unsupported_fields_are_errors(tmp_path):
    import dataclasses

    from megatron_lite.checkpoint.errors import CheckpointError
    from megatron_lite.config import ModelConfig
    from tools.hf_families import from_hf_config, to_hf_config

    mixtral = moe_hf_model("mixtral").config.to_dict()
    with pytest.raises(CheckpointError, match="sliding_window"):
        from_hf_config({**mixtral, "sliding_window": 4096})
    with pytest.raises(CheckpointError, match="model_type='deepseek_v2'"):
        from_hf_config({**mixtral, "model_type": "deepseek_v2"})
    ours = dataclasses.asdict(ModelConfig(num_experts=4, moe_router_norm_topk=True))
    assert to_hf_config(ours, 128)["architectures"] == ["MixtralForCausalLM"]
    with pytest.raises(CheckpointError, match="moe_router_score_function"):
        to_hf_config({**ours, "moe_router_score_function": "sigmoid"}, 128)
    with pytest.raises(CheckpointError, match="moe_shared_expert_ffn_hidden_size"):
        to_hf_config({**ours, "moe_shared_expert_ffn_hidden_size": 64}, 128)
    with pytest.raises(CheckpointError, match="Mixtral"):  # dense layer, no q/k norms
        to_hf_config({**ours, "num_layers": 2, "moe_layer_freq": [0, 1]}, 128)


def test_llama_head_dim_maps_to_kv_channels():
    """A Llama head_dim other than hidden/heads (model.kv_channels) converts both ways."""
    from tools.hf_families import from_hf_config, to_hf_config

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32).to_dict()
    ours = from_hf_config(config)
    assert ours["kv_channels"] == 32
    assert from_hf_config({**config, "head_dim": 16})["kv_channels"] is None  # = hidden/heads
    back = to_hf_config(ours, vocab_size=config["vocab_size"])
    assert back["head_dim"] == 32 and back["architectures"] == ["LlamaForCausalLM"]
