"""Context parallelism of every type (Ulysses a2a, ring p2p, hybrid a2a+p2p): loss parity
against one rank, and Ulysses' analytical all-to-all volume (the ring's: test_ring_attention.py)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks
from tests.parallel.parity import (
    SHORT,
    Curve,
    assert_parity,
    reference_losses,
    train_records,
)
from tests.parallel.test_moe import MOE

P2P = ["parallel.cp_comm_type=p2p"]
HYBRID = ["parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"]
LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"]),
    "cp4_gqa_replicated_kv": (4, ["parallel.cp=4"]),  # 2 KV groups < cp: replicated
    "tp2_cp2_sp": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"]),
    "cp2_pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
    "p2p_cp4": (4, [*P2P, "parallel.cp=4"]),
    # cp above the 4 heads: Ulysses pairs, a ring of 4 (8 ranks on 2 cores: 3 steps)
    "hybrid_cp8_4heads": (8, [*HYBRID, "parallel.cp=8", "train.steps=3"]),
    "p2p_cp2_tp2_sp_zero1": (
        8,
        [
            *P2P,
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.zero_stage=1",
        ],
    ),
    "hybrid_cp4_pp2": (8, [*HYBRID, "parallel.cp=4", "parallel.pp=2"]),
    "p2p_cp2_ep2": (2, [*P2P, "parallel.cp=2", "parallel.ep=2"]),
}
MODELS = {"llama": ["model.arch=llama", *SHORT], "gpt": ["model.arch=gpt", *SHORT],
          "moe": [*MOE, *SHORT]}  # fmt: skip
# each layout on the models it can break: plain CP on both (RoPE offsets; GPT's learned
# positions and biases), GQA with KV groups replicated over CP on llama, TP+SP+CP on GPT (its
# biases and LayerNorm under SP), CP with pipeline stages on llama; the ring (p2p, a2a+p2p)
# likewise, with ZeRO-1 beside TP+SP on GPT, cp above the head count, and expert parallelism
# (plain p2p cp=2 and a2a+p2p cp=4 run under document masking: test_document_masking.py)
CASES = [("cp2", "llama"), ("cp2", "gpt"), ("cp4_gqa_replicated_kv", "llama"),
         ("tp2_cp2_sp", "gpt"), ("cp2_pp2", "llama"),
         ("p2p_cp4", "llama"), ("hybrid_cp8_4heads", "llama"), ("p2p_cp2_tp2_sp_zero1", "gpt"),
         ("hybrid_cp4_pp2", "llama"), ("p2p_cp2_ep2", "moe")]  # fmt: skip


# the collectives each CP type must use (comm_bytes/<kind> in metrics.jsonl), and must not
USES = {"a2a": ("all_to_all", "cp_send"), "p2p": ("cp_send", "all_to_all"),
        "a2a+p2p": (("all_to_all", "cp_send"), ())}  # fmt: skip


@pytest.mark.parity
@pytest.mark.parametrize("layout,model", CASES)
def test_cp_loss_parity(layout, model):
    world, overrides = LAYOUTS[layout]
    ref = reference_losses(tuple(MODELS[model]))
    keys = ("loss", "grad_norm", "comm_bytes/all_to_all", "comm_bytes/cp_send")
    got = train_records(world, MODELS[model] + overrides, keys)
    n = len(got)  # a layout may train fewer steps: the same first steps of the reference
    assert_parity(got, Curve(ref[:n], ref.grad_norms[:n]), f"{layout} {model}")
    kind = next((o.split("=")[1] for o in overrides if "cp_comm_type" in o), "a2a")
    uses, not_used = USES[kind]
    for key in (uses,) if isinstance(uses, str) else uses:
        assert got[0].get(f"comm_bytes/{key}", 0) > 0, f"{layout}: no {key} traffic: {got[0]}"
    if model == "moe":  # the expert dispatch is an all-to-all too
        not_used = ()
    for key in (not_used,) if isinstance(not_used, str) else not_used:
        assert f"comm_bytes/{key}" not in got[0], f"{layout} ({kind}) used {key}: {got[0]}"


def _ulysses_vs_local(rank, world, n, g):
    from megatron_lite.context.ulysses import ulysses_attention
    from megatron_lite.models.attention import sdpa_attention as core_attention
    from megatron_lite.parallel.comm_stats import STATS

    torch.manual_seed(0)
    s, b, d = 8, 2, 4
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for h in (n, g, g))
    gout = torch.randn(s, b, n, d, dtype=torch.float64)
    shard = [t.chunk(world)[rank].clone().requires_grad_() for t in (q, k, v)]
    STATS.start_step(0)
    out = ulysses_attention(*shard, dist.group.WORLD, lambda a, b_, c: core_attention(a, b_, c, 0))
    elements, calls = STATS.elements["all_to_all"], STATS.calls["all_to_all"]
    out.backward(gout.chunk(world)[rank])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = core_attention(*full, 0.0)
    ref.backward(gout)
    errs = [float((out - ref.chunk(world)[rank]).abs().max())]
    errs += [
        float((a.grad - r.grad.chunk(world)[rank]).abs().max())
        for a, r in zip(shard, full, strict=False)
    ]
    return max(errs), elements, calls


@pytest.mark.parametrize("n,g", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa_replicated"])
def test_ulysses_matches_local_attention_and_volume(n, g):
    world, s, b, d = 2, 8, 2, 4
    for err, elements, calls in run_ranks(world, _ulysses_vs_local, n, g, timeout=60):
        assert err < 1e-12, f"Ulysses vs full attention: max error {err}"
        # forward payload per rank: q, k, v, out = (2 + 2·g'/n)·s·b·n·d / cp (g' = KV heads
        # after replication up to cp)
        g_eff = max(g, world)
        assert elements == (2 + 2 * g_eff / n) * s * b * n * d / world
        assert calls == 2, f"q, k, v should travel in one all-to-all, the output in one: {calls}"
