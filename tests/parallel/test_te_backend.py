"""model.linear_backend=te on CPU through a stand-in Transformer Engine (tests/fake_te, which
handles meta-device construction as TE does): each TE Linear creates its weight and the layer
owns that very Parameter (built on meta: TE defers its init, no CUDA allocation, no draw); the
transformer-layer GEMMs go through TE, so the fp32 losses equal the local backend's, and
model.fp8 runs those GEMMs inside TE's autocast with the configured recipe and the tp×cp×dp
amax group. Real TE needs CUDA (tools/gpu_check.sh)."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.dist_harness import run_ranks
from tests.parallel.parity import (
    SHORT,
    SHORT_STEPS,
    TINY,
    _train,
    max_rel_diff,
    reference_losses,
    structured_dataset,
)

FAKE_TE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fake_te")
TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LLAMA = ("model.arch=llama", *SHORT)  # the parity tables' single-rank reference


def _layers(gemm: str):
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear

    col = ColumnParallelLinear(8, [4, 2], None, bias=True, gemm=gemm)
    return col, RowParallelLinear(6, 8, None, bias=False, gemm=gemm)


def test_te_creates_the_weight_the_layer_owns_deferred_on_meta(fake_te):
    """Built on meta (every model build: init=False, or ZeRO-3's meta shards), TE defers its
    init as it documents (device="meta", the string), nothing lands on CUDA, and the layer's
    weight is the Parameter TE registered, with TE's fp8 slot; materialize keeps that object,
    so after the draw TE computes with the layer's values and the gradient reaches them."""
    from megatron_lite.parallel.params import init_parameters, materialize

    stats = dict(fake_te.STATS)
    with torch.device("meta"):
        layers = _layers("te")
    assert fake_te.STATS["deferred"] - stats["deferred"] == 2, fake_te.STATS
    assert fake_te.STATS["materialized_on_cuda"] == stats["materialized_on_cuda"], fake_te.STATS
    for layer in layers:
        te_linear = layer._gemm.linear
        assert te_linear.weight is layer.weight and layer.weight.is_meta
        assert te_linear.param_init_meta["weight"].fp8_meta_index == fake_te.GEMM1_WEIGHT
        materialize(layer, torch.device("cpu"))
        init_parameters(layer, seed=3)
        assert te_linear.weight is layer.weight and not layer.weight.is_meta
    col, row = layers
    x = torch.randn(3, 2, 8)
    y = row(col(x)[..., :6])
    want = F.linear(F.linear(x, col.weight, col.bias)[..., :6], row.weight)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.sum().backward()
    assert col.weight.grad is not None and row.weight.grad is not None


def test_te_weights_are_drawn_as_the_local_backends(fake_te):
    """Built on a real device, TE's weight gets storage there and the layer's initializer
    draws the same values as for gemm="local" (names and metadata unchanged)."""
    from megatron_lite.parallel.params import init_parameters

    drawn = {}
    for gemm in ("local", "te"):
        layers = torch.nn.ModuleList(_layers(gemm))
        init_parameters(layers, seed=3)
        drawn[gemm] = dict(layers.named_parameters())
    assert drawn["te"].keys() == drawn["local"].keys()
    for name, p in drawn["te"].items():
        assert torch.equal(p, drawn["local"][name]), name
        assert p.meta == drawn["local"][name].meta, name


def test_a_replaced_te_weight_is_refused(fake_te):
    """TE computes with the Parameter it created: a layer whose weight was replaced (here as
    to_empty does, by a new Parameter) fails with the fix instead of computing with TE's."""
    col, _ = _layers("te")
    col.weight = torch.nn.Parameter(torch.randn_like(col.weight))
    with pytest.raises(ValueError, match="fill the weight in place"):
        col(torch.randn(3, 2, 8))


def _train_with_fake_te(rank, world, overrides, out_dir):

    sys.path.insert(0, FAKE_TE)
    import transformer_engine.pytorch as te

    from megatron_lite import optional

    optional._cuda = lambda: True  # the stand-in runs on CPU
    losses = _train(rank, world, overrides, out_dir)
    return losses, {k: v for k, v in te.STATS.items()}


def _run(world, overrides, tmp):
    data = f"data.paths=[{structured_dataset()}]"
    results = run_ranks(world, _train_with_fake_te, [*TINY, data, *overrides], tmp, timeout=180)
    return results[0][0], [stats for _, stats in results]


def test_te_linears_match_local_backend(tmp_path):
    ref = reference_losses(LLAMA)
    got, stats = _run(2, ["model.linear_backend=te", *TP2_SP, *SHORT], str(tmp_path))
    diff = max_rel_diff(got, ref)
    print(f"TE-LINEAR tp2+SP: max rel diff vs local 1 rank {diff:.2e}")
    assert diff < 1e-4, f"{got}\n{ref}"
    for s in stats:  # 4 layers × (qkv, proj, fc1, fc2); steps × 4 microbatches × 4 layers
        assert s["linears"] == 16, s
        assert s["forwards"] == 16 * SHORT_STEPS * 4, s
        assert s["fp8_forwards"] == 0 and not s["autocasts"], s


# recipe, world, layout, linears per rank (4 per layer), microbatches per step, amax groups
FP8_CASES = {
    "tensorwise_tp2_dp2": ("tensorwise", 4, [], 16, 2, [(0, 1, 2, 3)]),
    # delayed scaling all-reduces amaxes after each region: a group spanning both pipeline
    # stages would deadlock, so the stage's own tp×cp×dp ranks must be used
    "delayed_tp2_pp2": ("delayed", 4, ["parallel.pp=2"], 8, 4, [(0, 1), (2, 3)]),
}


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_runs_te_gemms_under_autocast(case, tmp_path):
    recipe, world, layout, linears, micro, groups = FP8_CASES[case]
    ref = reference_losses(LLAMA)
    fp8 = [
        "model.linear_backend=te",
        "model.fp8=hybrid",
        f"model.fp8_recipe={recipe}",
        "train.precision=bf16",
    ]
    got, stats = _run(world, [*fp8, *TP2_SP, *layout, *SHORT], str(tmp_path))
    diff = max_rel_diff(got, ref)
    print(f"FP8 {case} (stand-in TE): max rel diff vs fp32 {diff:.2e}")
    assert 1e-5 < diff < 5e-2, f"FP8 rounding should show, but stay small: {got} vs {ref}"
    name = {"tensorwise": "Float8CurrentScaling", "delayed": "DelayedScaling"}[recipe]
    for rank, s in enumerate(stats):  # one autocast per microbatch forward
        assert s["linears"] == linears and s["fp8_forwards"] == s["forwards"], s
        assert s["forwards"] == linears * SHORT_STEPS * micro, s
        group = next(g for g in groups if rank in g)
        assert set(s["autocasts"]) == {(name, "HYBRID", group)}, s["autocasts"][:3]
        assert len(s["autocasts"]) == SHORT_STEPS * micro, len(s["autocasts"])
