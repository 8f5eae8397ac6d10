"""Multi-head latent attention (model.multi_latent_attention, models/mla.py).

1. The module against Hugging Face transformers' `DeepseekV3Attention` on the same weights
   (fp32, one rank): output and every gradient within 1e-5 relative, with q_lora_rank set and
   null, with plain RoPE and YaRN (factor 40; mscale_all_dim 1: the softmax scale's mscale²;
   mscale_all_dim 0: the attention factor on cos/sin). Weights are drawn large enough that a
   wrong softmax scale, a RoPE left interleaved, rotating the wrong dims, or plain RoPE tables
   in place of YaRN's move the output by more than 1e-2 relative (the test breaks the module
   each way and checks that).
2. Loss parity with one rank (the suite's bounds) for an MLA + MoE model (DeepSeek-style:
   sigmoid routing with expert bias, a shared expert, a first dense layer, YaRN) on tp2+SP,
   cp2 p2p, cp2 a2a, cp4 a2a+p2p, selective and full recompute, and document masking.
"""

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import DOCS, SHORT, assert_parity, reference_losses, train_losses

H, N, Q_LORA, KV_LORA, NOPE, ROPE, V, SEQ, BATCH, THETA = 64, 4, 24, 16, 12, 8, 6, 16, 2, 100.0
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1}  # fmt: skip
YARN_FACTOR = {**YARN, "mscale_all_dim": 0}  # no softmax mscale: cos/sin × mscale(40) instead
CASES = {  # (q_lora_rank, rope_scaling, MEGATRON_LITE_KERNELS)
    "q_lora": (Q_LORA, None, None),
    "no_q_lora": (None, None, None),
    "yarn": (Q_LORA, YARN, None),
    "yarn_attention_factor": (None, YARN_FACTOR, None),
    # the Triton RMSNorm and RoPE kernels (in the interpreter on CPU) on MLA's latents and
    # its de-interleaved RoPE dims
    "yarn_triton": (Q_LORA, YARN, "triton"),
}


def _hf_attention(q_lora, scaling):
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    rope = {"rope_type": "default", "rope_theta": THETA}
    if scaling is not None:
        rope = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn",
                "rope_theta": THETA}  # fmt: skip
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=H, num_attention_heads=N, num_key_value_heads=N,
        q_lora_rank=q_lora, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, rms_norm_eps=1e-6, max_position_embeddings=4 * SEQ, rope_parameters=rope,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    attn = DeepseekV3Attention(config, 0).float()
    with torch.no_grad():  # logits of a few units, norms away from 1
        for name, p in attn.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.3)
    return attn, DeepseekV3RotaryEmbedding(config)


def _ours(q_lora, scaling):
    from megatron_lite.config import load_config
    from megatron_lite.models import TransformerConfig
    from megatron_lite.models.mla import MLASelfAttention
    from megatron_lite.parallel.mesh import ParallelMesh
    from megatron_lite.parallel.random import RNGStatesTracker
    from megatron_lite.resolve import rank_layout

    overrides = [
        "model.multi_latent_attention=true", f"model.hidden_size={H}",
        f"model.num_attention_heads={N}", f"model.q_lora_rank={q_lora or 'null'}",
        f"model.kv_lora_rank={KV_LORA}", f"model.qk_head_dim={NOPE}",
        f"model.qk_pos_emb_head_dim={ROPE}", f"model.v_head_dim={V}", "model.norm_eps=1e-6",
        f"model.rope_theta={THETA}", f"model.seq_length={SEQ}", "model.vocab_size=64",
        "data.mock=true",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    cfg.model.rope_scaling = scaling
    config = TransformerConfig.from_config(cfg, 1)
    return MLASelfAttention(config, ParallelMesh(rank_layout(cfg.parallel, 1)), RNGStatesTracker())


def _compare(rank, world, q_lora, scaling, kernels):
    """Relative differences of our module from HF's: (output, worst gradient), and the output's
    when the module is broken (softmax scale, interleave, RoPE dims)."""
    import os

    import torch

    if kernels is not None:
        os.environ["MEGATRON_LITE_KERNELS"] = kernels  # read at each call

    from megatron_lite.models import mla
    from megatron_lite.models.token_context import TokenContext
    from megatron_lite.models.transformer import rope_tables

    hf, rotary = _hf_attention(q_lora, scaling)
    ours = _ours(q_lora, scaling)
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(hf_params[name])
    assert {n for n, _ in ours.named_parameters()} == set(hf_params)

    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, H, requires_grad=True)
    pos = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    ref, _ = hf(x, rotary(x, pos), None)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)

    def run(module, tables=scaling):
        xs = x.detach().transpose(0, 1).clone().requires_grad_()  # [s, b, h]
        ctx = TokenContext(rope_tables(SEQ, ROPE, THETA, scaling=tables))
        out = module(xs, ctx).transpose(0, 1)
        return out, xs

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    out, xs = run(ours)
    out.backward(grad_out)
    grads = [rel(xs.grad.transpose(0, 1), x.grad)]
    grads += [rel(p.grad, hf_params[n].grad) for n, p in ours.named_parameters()]
    broken = {}
    with torch.no_grad():
        ours.q_scale = 1.0 if ours.q_scale != 1.0 else 1.25  # a wrong softmax scale
        broken["softmax_scale"] = rel(run(ours)[0], ref)
        ours.q_scale = mla.rope_scaling.softmax_scale_factor(scaling)
        if scaling is not None:  # plain RoPE tables: no YaRN frequencies, no attention factor
            broken["yarn_tables"] = rel(run(ours, None)[0], ref)
        deinterleave = mla.deinterleave
        mla.deinterleave = lambda t: t  # RoPE on interleaved pairs as if half-rotation
        broken["interleave"] = rel(run(ours)[0], ref)
        mla.deinterleave = deinterleave
        # the RoPE part read from the wrong dims of each query head: its rows rolled so the
        # module's [nope | rope] split takes rope + part of nope as "nope"
        w = (ours.q_proj or ours.q_b_proj).weight
        heads = w.view(N, NOPE + ROPE, -1)
        heads.copy_(torch.roll(heads.clone(), ROPE, dims=1))
        broken["rope_split"] = rel(run(ours)[0], ref)
    return rel(out, ref), max(grads), broken


# YaRN's attention-factor form and the Triton kernels in the slow tier (the suite's budget)
SLOW_CASES = {"yarn", "yarn_attention_factor", "yarn_triton"}


@pytest.mark.parametrize(
    "case", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_CASES else k for k in CASES]
)
def test_mla_matches_hf_deepseek_v3_attention(case):
    pytest.importorskip("transformers")
    out, grad, broken = run_ranks(1, _compare, *CASES[case], timeout=120)[0]
    print(f"MLA vs HF {case}: output {out:.1e}, gradients {grad:.1e}, broken {broken}")
    assert out < 1e-5, f"{case}: output differs from HF's by {out:.2e} (relative)"
    assert grad < 1e-5, f"{case}: a gradient differs from HF's by {grad:.2e} (relative)"
    for what, diff in broken.items():
        assert diff > 1e-2, f"{case}: a broken {what} moves the output by only {diff:.1e}"


def _bf16_errors(rank, world, q_lora, scaling):
    """Relative errors of HF's module and ours in bf16 (weights and input rounded alike) from
    HF's in fp32."""
    import copy

    import torch

    from megatron_lite.models.token_context import TokenContext
    from megatron_lite.models.transformer import rope_tables

    hf, rotary = _hf_attention(q_lora, scaling)
    ours = _ours(q_lora, scaling)
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(hf_params[name])
        torch.manual_seed(1)
        x = torch.randn(BATCH, SEQ, H).bfloat16().float()
        pos = torch.arange(SEQ)[None].expand(BATCH, SEQ)
        ref = hf(x, rotary(x, pos), None)[0]
        hf16, x16 = copy.deepcopy(hf).bfloat16(), x.bfloat16()
        out_hf = hf16(x16, rotary(x16, pos), None)[0].float()
        ctx = TokenContext(rope_tables(SEQ, ROPE, THETA, scaling=scaling))
        out = ours.bfloat16()(x16.transpose(0, 1), ctx).transpose(0, 1).float()
    scale = ref.abs().max()
    return ((out_hf - ref).abs().max() / scale).item(), ((out - ref).abs().max() / scale).item()


@pytest.mark.slow
def test_mla_bf16_is_as_close_to_fp32_as_hfs():
    """bf16: our module is no further from HF's fp32 output than HF's own bf16 module is."""
    pytest.importorskip("transformers")
    err_hf, err_ours = run_ranks(1, _bf16_errors, Q_LORA, YARN, timeout=120)[0]
    print(f"MLA bf16 vs fp32: HF {err_hf:.1e}, ours {err_ours:.1e}")
    assert err_ours < max(2 * err_hf, 1e-2), (err_hf, err_ours)


# DeepSeek-like: MLA with YaRN, MoE with sigmoid routing, expert bias, a shared expert, top-2 of
# 4, the first layer dense; 4 heads (q/k 12 + 8 = 20 wide, v 10: v differs from q/k)
MLA = [
    "model.multi_latent_attention=true", "model.num_query_groups=4", "model.q_lora_rank=32",
    "model.kv_lora_rank=24", "model.qk_head_dim=12", "model.qk_pos_emb_head_dim=8",
    "model.v_head_dim=10",
    "model.rope_scaling={type: yarn, factor: 40, original_max_position_embeddings: 16, "
    "mscale: 1, mscale_all_dim: 1}",
    "model.num_layers=2", *SHORT,
]  # fmt: skip
MLA_MOE = [
    *MLA, "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
    "model.moe_shared_expert_ffn_hidden_size=32", "model.moe_first_k_dense_replace=1",
    "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
]  # fmt: skip
SELECTIVE = ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"]
FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1"]  # fmt: skip
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
EOD = 249
# (ranks, model, parallel overrides, whether on documents)
LAYOUTS = {
    "tp2_sp_selective": (2, MLA_MOE, [*SP, *SELECTIVE], False),
    "cp2_p2p_full": (2, MLA_MOE, ["parallel.cp=2", "parallel.cp_comm_type=p2p", *FULL], False),
    "cp2_a2a": (2, MLA_MOE, ["parallel.cp=2", "parallel.cp_comm_type=a2a"], False),
    "cp2_p2p_documents": (2, MLA_MOE, ["parallel.cp=2", "parallel.cp_comm_type=p2p"], True),
    "tp2_sp_documents": (2, MLA_MOE, SP, True),
    # dense: TP without SP (MoE needs SP), the down-projections' gradients not summed
    "tp2_dense": (2, MLA, ["parallel.tp=2"], False),
    "cp4_a2a_p2p": (4, MLA_MOE, ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p",
                                 "parallel.cp_a2a_size=2"], False),
}  # fmt: skip


# the documents on tp2+SP, dense TP and cp4 a2a+p2p in the slow tier (the suite's budget;
# tests/parallel/test_deepseek_v3_parity.py runs documents under CP in the suite)
SLOW_LAYOUTS = {"tp2_sp_documents", "tp2_dense", "cp4_a2a_p2p", "cp2_a2a", "cp2_p2p_documents"}


@pytest.mark.parity
@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k for k in LAYOUTS],
)
def test_mla_loss_parity(layout, tmp_path):
    world, model, parallel, documents = LAYOUTS[layout]
    model, eod = (model + DOCS, EOD) if documents else (model, None)
    ref = reference_losses(tuple(model), eod=eod)
    assert ref[-1] < ref[0] - 0.1, f"reference loss did not fall: {list(ref)}"
    got = train_losses(world, [*model, *parallel], str(tmp_path), eod=eod)
    assert_parity(got, ref, f"MLA {layout}")


def test_mla_changes_the_model():
    """The flag reaches the model: an MLA model's losses differ from the plain one's."""
    plain = reference_losses(tuple(SHORT))
    latent = reference_losses(tuple(MLA[:8] + list(SHORT)))
    assert abs(latent[0] - plain[0]) > 1e-4, (list(latent), list(plain))


PROMPTS = [[5, 17, 3, 9, 44, 61], [12], [7, 7, 2, 30]]  # lengths 6, 1, 4: left padding


def _generated(rank, world):
    """Greedy tokens of a random MLA model (YaRN) on `world` TP ranks: the batch with the KV
    cache, each prompt alone, and the batch recomputed without the cache."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.generation.decode import generate
    from megatron_lite.generation.model import generation_config
    from megatron_lite.models import build_model
    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout
    from megatron_lite.parallel.random import RNGStatesTracker

    m = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, seq_length=32,
        tie_embeddings=False, init_method_std=0.2, multi_latent_attention=True, q_lora_rank=16,
        kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=8,
        rope_scaling=dict(YARN, original_max_position_embeddings=8),
    )  # fmt: skip
    mesh = ParallelMesh(RankLayout(world, tp=world))
    (chunk,) = build_model(generation_config(m, world), mesh, RNGStatesTracker(), 96)
    chunk.eval()
    batch = generate(chunk, mesh.tp, PROMPTS, 12, 96)
    alone = [generate(chunk, mesh.tp, [p], 12, 96)[0] for p in PROMPTS]
    return batch, alone, generate(chunk, mesh.tp, PROMPTS, 12, 96, kv_cache=False)


@pytest.mark.slow
def test_mla_kv_cached_generation_equals_recomputing():
    """KV-cached decoding through MLA (per-row RoPE positions of left-padded prompts, YaRN
    tables, v narrower than q/k in the cache) gives the tokens a full recompute gives, on one
    rank and on tp2."""
    for world in (1, 2):
        for batch, alone, full in run_ranks(world, _generated):
            assert batch == alone, f"tp{world}: batched {batch} vs each alone {alone}"
            assert batch == full, f"tp{world}: cached {batch} vs recomputed {full}"
            assert len({tuple(row) for row in batch}) > 1, batch


@pytest.mark.slow
def test_mla_on_te_linears(tmp_path):
    """model.linear_backend=te (a Transformer Engine stand-in on CPU, tests/fake_te): every MLA
    linear, the replicated down-projections included, runs through TE's GEMM on tp2+SP, and
    the losses are the local backend's on one rank (test_te_backend's bound)."""
    from tests.parallel.parity import max_rel_diff
    from tests.parallel.test_te_backend import _run

    ref = reference_losses(tuple(MLA))
    got, stats = _run(2, [*MLA, "model.linear_backend=te", *SP], str(tmp_path))
    diff = max_rel_diff(got, ref)
    print(f"MLA TE-LINEAR tp2+SP: max rel diff vs local 1 rank {diff:.2e}")
    assert diff < 1e-4, f"{got}\n{ref}"
    for s in stats:  # 2 layers × (q_a, q_b, kv_a, kv_b, o_proj, fc1, fc2)
        assert s["linears"] == 14, s


def test_sdpa_with_a_narrower_v_keeps_no_scores():
    """SDPA on q/k of width 12 and v of width 8 (MLA's shapes): the output is plain softmax
    attention's (float64 reference), and nothing s×s is kept for backward (v is zero-padded to
    q's width, so SDPA's flash kernel runs instead of its math path, which keeps the
    probabilities)."""
    import torch

    from megatron_lite.models.attention import sdpa_attention

    s, b, n, dk, dv = 64, 2, 4, 12, 8
    torch.manual_seed(0)
    q, k = (torch.randn(s, b, n, dk, requires_grad=True) for _ in range(2))
    v = torch.randn(s, b, n, dv, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        out = sdpa_attention(q, k, v, 0.0)
    assert not [shape for shape in saved if tuple(shape[-2:]) == (s, s)], saved
    qd, kd, vd = (t.detach().double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    scores = qd @ kd.transpose(-1, -2) / dk**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ vd).permute(2, 0, 1, 3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_mla_bf16_tracks_fp32(tmp_path):
    """bf16 training of the MLA + MoE model on tp2+SP follows the fp32 single-rank curve to
    bf16 rounding (test_parity_core's bound)."""
    from tests.parallel.parity import max_rel_diff

    ref = reference_losses(tuple(MLA_MOE))
    got = train_losses(2, [*MLA_MOE, *SP, "train.precision=bf16"], str(tmp_path))
    diff = max_rel_diff(got, ref)
    print(f"MLA BF16 tp2+SP: max rel diff vs fp32 {diff:.2e}")
    assert diff < 5e-3, f"bf16 run drifts from fp32: {got} vs {ref}"
