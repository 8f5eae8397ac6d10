"""Model FLOPs: the stated formula in float64 by hand, and against torch's FlopCounterMode
counting the real matmuls of a tiny model's forward + backward (dense GQA llama, GeLU gpt, MoE)."""

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
    "moe_mtp": [
        "model.num_experts=4",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=48",
        "model.moe_first_k_dense_replace=1",
        "model.moe_shared_expert_ffn_hidden_size=40",
        "model.ffn_hidden_size=64",
        "model.mtp_num_layers=2",
    ],  # fmt: skip
}


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
    q = m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    layers = m.num_layers + m.mtp_num_layers  # each MTP module runs one layer
    causal = 6 * layers * m.seq_length * q * tokens
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


def test_peak_tflops_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("b200") == 2250.0
    with pytest.raises(ValueError, match="unknown GPU 'Tesla T4'"):
        peak_tflops("Tesla T4")
