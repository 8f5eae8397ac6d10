"""Ulysses context parallelism: loss parity against one rank, and the analytical all-to-all
volume."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks
from tests.parallel.parity import SHORT, assert_parity, reference_losses, train_losses

LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"]),
    "cp4_gqa_replicated_kv": (4, ["parallel.cp=4"]),  # 2 KV groups < cp: replicated
    "tp2_cp2_sp": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"]),
    "cp2_pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
}
MODELS = {"llama": ["model.arch=llama", *SHORT], "gpt": ["model.arch=gpt", *SHORT]}
# each layout on the models it can break: plain CP on both (RoPE offsets; GPT's learned
# positions and biases), GQA with KV groups replicated over CP on llama, TP+SP+CP on GPT (its
# biases and LayerNorm under SP), CP with pipeline stages on llama
CASES = [("cp2", "llama"), ("cp2", "gpt"), ("cp4_gqa_replicated_kv", "llama"),
         ("tp2_cp2_sp", "gpt"), ("cp2_pp2", "llama")]  # fmt: skip


@pytest.mark.parity
@pytest.mark.parametrize("layout,model", CASES)
def test_cp_loss_parity(layout, model, tmp_path):
    world, overrides = LAYOUTS[layout]
    ref = reference_losses(tuple(MODELS[model]))
    got = train_losses(world, MODELS[model] + overrides, str(tmp_path))
    assert_parity(got, ref, f"{layout} {model}")


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
