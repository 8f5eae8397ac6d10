"""Model FLOPs: the stated formula in float64 by hand, and against torch's FlopCounterMode
counting the real matmuls of a tiny model's forward + backward (dense GQA llama, GeLU gpt, MoE,
multi-head latent attention with and without q compression)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config import load_config
from megatron_lite.training.flops import matmul_params_per_token, model_flops_per_token, peak_tflops
from tests.dist_harness import run_ranks

# vocab 256 is a multiple of make_vocab_size_divisible_by (128): no padding columns
BASE = ["model.vocab_size=256", "model.num_layers=2", "model.hidden_size=32",
        "model.num_attention_heads=4", "model.seq_length=16", "train.micro_batch_size=2",
        "train.global_batch_size=4", "train.steps=1", "data.mock=true"]  # fmt: skip
CASES = {
    "llama_gqa": ["model.num_query_groups=2", "model.ffn_hidden_size=64"],
    "gpt": ["model.arch=gpt", "model.ffn_hidden_size=64"],
    # heads · kv_channels = 64 != hidden 32 (Qwen3-style), q/k norms are no matmuls
    "llama_kv_channels": [
        "model.num_query_groups=2",
        "model.ffn_hidden_size=64",
        "model.kv_channels=16",
        "model.qk_layernorm=true",
    ],
    "moe": [
        "model.num_experts=4",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=48",
        "model.moe_layer_freq=2",
        "model.ffn_hidden_size=64",
    ],  # fmt: skip
    "moe_shared_first_dense": [  # DeepSeek-V3's shape: a dense first layer, a shared expert
        "model.num_experts=4",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=48",
        "model.moe_first_k_dense_replace=1",
        "model.moe_shared_expert_ffn_hidden_size=40",
        "model.ffn_hidden_size=64",
    ],  # fmt: skip
    # multi-token prediction: a dense MTP layer (the last main layer is dense), then two MoE
    # ones after an MoE last layer (DeepSeek-V3's), with the shared expert
    "llama_mtp": ["model.num_query_groups=2", "model.ffn_hidden_size=64", "model.mtp_num_layers=1"],
}
CASES["moe_mtp"] = [*CASES["moe_shared_first_dense"], "model.mtp_num_layers=2"]
# multi-head latent attention: q/k 12 + 4 wide, v 6 (!= q/k), compressed q and kv
MLA = ["model.multi_latent_attention=true", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_head_dim=12", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=6",
       "model.ffn_hidden_size=64"]  # fmt: skip
CASES["mla_moe"] = [*MLA, *CASES["moe_shared_first_dense"][:-1]]
CASES["mla_no_q_lora"] = [*MLA, "model.q_lora_rank=null"]


def _attention_per_token(m) -> int:
    """Attention FLOPs per token and layer over causal scores (fwd + bwd): 6·s·q for q = n·d,
    3·s·n·(dn + dr + dv) for MLA (Q·Kᵀ over dn + dr, A·V over dv)."""
    if m.multi_latent_attention:
        return (
            3
            * m.seq_length
            * m.num_attention_heads
            * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim)
        )
    q = m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    return 6 * m.seq_length * q


def test_hand_formula_llama_gqa():
    cfg = load_config(None, [*BASE, *CASES["llama_gqa"]])
    h, L, s, V, ffn, d = 32, 2, 16, 256, 64, 8
    q, kv = 4 * d, 2 * d
    n = L * (h * q + 2 * h * kv + q * h + 3 * h * ffn) + h * V
    attention = L * 3 * (2 * 2 * s * q) / 2  # QKᵀ and AV, causal half, fwd + bwd
    assert model_flops_per_token(cfg) == pytest.approx(6 * n + attention, rel=1e-15)


def _addmm_inplace_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    """torch._grouped_mm (the grouped-GEMM experts), which torch's table leaves out: [N, K] ×
    [G, K, M] -> [N, M] (each row by its group's matrix) or [K, N] × [N, M] -> [G, K, M] (the
    weight gradient, N split into groups): 2 · (the output's last two dims) · a's last."""
    return 2 * out_shape[-2] * out_shape[-1] * a_shape[-1]


def _counted(rank, world, overrides, out_dir):
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.train import prepare
    from megatron_lite.training.trainer import Trainer

    cfg, dataset, vocab = prepare(["train.out_dir=" + out_dir, *overrides], world_size=world)
    trainer = Trainer(cfg, ParallelMesh(RankLayout(world)), dataset, vocab)
    micro = trainer._fetch(0)
    # the fused wgrad accumulates into main_grad with addmm_, which torch's table leaves out
    inplace = {
        torch.ops.aten.addmm_: _addmm_inplace_flops,
        torch.ops.aten._grouped_mm: _grouped_mm_flops,
    }
    with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
        trainer._forward_backward(micro, 1.0)
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return by_op


@pytest.mark.parametrize("case", list(CASES))
def test_matches_counted_matmuls(case, tmp_path):
    overrides = [*BASE, *CASES[case]]
    cfg = load_config(None, overrides)
    by_op = run_ranks(1, _counted, overrides, str(tmp_path), timeout=60)[0]
    tokens = 4 * 16
    attention = {k: v for k, v in by_op.items() if "attention" in k}
    matmul = sum(v for k, v in by_op.items() if k not in attention)
    m = cfg.model
    layers = m.num_layers + m.mtp_num_layers  # each MTP module runs one layer
    causal = layers * _attention_per_token(m) * tokens
    assert matmul + causal == model_flops_per_token(cfg) * tokens, by_op
    if attention:  # SDPA is counted on CUDA, not for the CPU kernel: full s×s scores
        assert sum(attention.values()) == 2 * causal, by_op


def test_attention_term_is_half_the_full_scores_and_values():
    """Counted Q·Kᵀ and A·V GEMMs of plain attention, forward + backward, over the full s×s
    scores: twice the causal term per token and layer (6·s·q)."""
    b, n, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for _ in range(3))
    # the fused wgrad accumulates into main_grad with addmm_, which torch's table leaves out
    inplace = {
        torch.ops.aten.addmm_: _addmm_inplace_flops,
        torch.ops.aten._grouped_mm: _grouped_mm_flops,
    }
    with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
        out = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1) @ v
        out.sum().backward()
    cfg = load_config(None, [*BASE, "model.num_layers=1", "model.vocab_size=1"])
    per_token = model_flops_per_token(cfg) - 6 * matmul_params_per_token(cfg)
    assert counter.get_total_flops() == 2 * per_token * b * s


def test_hand_formula_mla():
    """MLA's FLOPs per token in float64 as Megatron-LM's num_floating_point_operations writes
    them (megatron/training/training.py, the multi_latent_attention branch), without its norm
    terms: 3·2·(q_term + kv_term + o_proj + core attention) per layer."""
    cfg = load_config(None, [*BASE, *MLA, "model.num_layers=1"])
    h, n, s, V, ffn = 32.0, 4.0, 16.0, 256.0, 64.0
    r_q, r_kv, dn, dr, dv = 24.0, 16.0, 12.0, 4.0, 6.0
    q_term = r_q * (h + n * (dn + dr))
    kv_term = r_kv * (h + n * (dn + dv)) + h * dr
    o_proj = n * dv * h
    core = s * n * (dn + dr) / 2 + s * n * dv / 2
    per_layer = 3 * 2 * (q_term + kv_term + o_proj + core)
    expected = per_layer + 6 * (3 * h * ffn + h * V)
    assert model_flops_per_token(cfg) == pytest.approx(expected, rel=1e-15)


def _mla_weights(rank, world, overrides):
    """The matmul weights of one MLA module (every 2-D parameter: its linears; the norms are
    1-D) and their names."""
    from megatron_lite.models import TransformerConfig
    from megatron_lite.models.mla import MLASelfAttention
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.random import RNGStatesTracker

    cfg = load_config(None, overrides)
    config = TransformerConfig.from_config(cfg, 1)
    mesh = ParallelMesh(RankLayout(1))
    with torch.device("meta"):
        attn = MLASelfAttention(config, mesh, RNGStatesTracker())
    return {name: p.numel() for name, p in attn.named_parameters() if p.dim() == 2}


@pytest.mark.parametrize("q_lora", ["24", "null"])
def test_mla_matmul_params_are_the_module_weights(q_lora):
    """N_active's attention part is the real MLA module's matmul weights, counted."""
    from megatron_lite.models.decoder import attention_flops

    overrides = [*BASE, *MLA, f"model.q_lora_rank={q_lora}"]
    weights = run_ranks(1, _mla_weights, overrides, timeout=60)[0]
    expected = {"kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight"}
    expected |= {"q_proj.weight"} if q_lora == "null" else {"q_a_proj.weight", "q_b_proj.weight"}
    assert set(weights) == expected
    assert attention_flops(load_config(None, overrides).model)[0] == sum(weights.values())


def test_mla_attention_term_counts_qk_and_v_widths():
    """Counted Q·Kᵀ over dn + dr and A·V over dv, forward + backward, full s×s scores: twice
    MLA's causal attention term per token and layer."""
    b, n, s, dqk, dv = 2, 4, 16, 16, 6
    q, k = (torch.randn(b, n, s, dqk, requires_grad=True) for _ in range(2))
    v = torch.randn(b, n, s, dv, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out = torch.softmax(q @ k.transpose(-1, -2) / dqk**0.5, dim=-1) @ v
        out.sum().backward()
    cfg = load_config(None, [*BASE, *MLA, "model.num_layers=1", "model.vocab_size=1"])
    per_token = model_flops_per_token(cfg) - 6 * matmul_params_per_token(cfg)
    assert counter.get_total_flops() == 2 * per_token * b * s


def test_peak_tflops_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("b200") == 2250.0
    with pytest.raises(ValueError, match="unknown GPU 'Tesla T4'"):
        peak_tflops("Tesla T4")
