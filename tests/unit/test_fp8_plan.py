"""The planner counts local FP8 (model.fp8=tensorwise): its layers' working sets and saved
bytes are measured on a layer with the FP8 GEMMs (plan/saved.py), and under ZeRO-3 with
model.fp8_all_gather the gathered FP8 weights take 1 byte an element (plan/peak.py). Checked
against the dry run of the real step (fake tensors, torchao's casts included), within the
planner-vs-dry-run tolerance of tests/unit/test_dry_run_planner.py, on the quickstart layout
(tp2 pp2 dp2, ZeRO-1) and on it under ZeRO-3; and the dry run's FSDP all-gather bytes fall
by one byte per FP8-gathered element per gather (plan/peak.py fp8_gathered_elements, which
the step time's ZeRO-3 gather uses)."""

import functools

import pytest

from tests.unit.test_dry_run_planner import TOLERANCE
from tests.unit.test_dry_run_planner import _dry_run as _dry_run_uncached

pytest.importorskip("torchao.float8")

QUICKSTART = ("configs/quickstart.yaml", 8, ["model.fp8=tensorwise", "train.precision=bf16"])


@functools.cache
def _cached(config: str, world: int, overrides: tuple[str, ...]) -> list[dict]:
    return _dry_run_uncached(config, world, list(overrides))


def _dry_run(config: str, world: int, overrides: list[str]) -> list[dict]:
    """The dry run's figures, once per layout in a session (ZeRO-3's FP8 run serves two tests;
    the results are read, never modified)."""
    return _cached(config, world, tuple(overrides))


# ZeRO-3 with FP8: the first weight gradient of a layer's backward (fc2's, bf16, out of the
# FP8 wgrad GEMM) is "grads" in the dry run (FSDP2's unsharded gradient) and a temporary in the
# planner's trace of the layer: measured on the quickstart's rank 0, grads 4.988 MiB against
# 4.816 and gathered+temporaries 3.783 against 3.893; their sum agrees within 0.7%
MERGED = ("grads", "gathered+temporaries")


def _terms(res: dict, key: str, merge: bool) -> dict[str, float]:
    terms = dict(res[key])
    if merge:
        terms["grads+gathered"] = sum(terms.pop(t) for t in MERGED)
    return terms


def _assert_terms_match(results: list[dict], label: str, merge: bool = False) -> None:
    for res in results:
        at = f"{label} pp rank {res['coords']['pp']}"
        predicted = _terms(res, "predicted", merge)
        for term, got in _terms(res, "compared", merge).items():
            want = predicted[term]
            assert abs(got - want) <= TOLERANCE * want or got == want == 0, (
                f"{at}, {term}: dry run {got / 2**20:.3f} MiB, planner {want / 2**20:.3f} MiB"
            )
        got, want = res["peak_bytes"], res["predicted_peak_bytes"]
        assert abs(got - want) <= TOLERANCE * want, f"{at}, peak: dry run {got}, planner {want}"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero", [1, 3])
def test_planner_counts_fp8_like_the_dry_run(zero):
    config, world, overrides = QUICKSTART
    results = _dry_run(config, world, [*overrides, f"parallel.zero_stage={zero}"])
    _assert_terms_match(results, f"quickstart fp8 zero{zero}", merge=zero == 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp8_all_gather_saves_a_byte_per_element_per_gather():
    from megatron_lite.config import load_config
    from megatron_lite.plan.__main__ import with_vocab
    from megatron_lite.plan.peak import fp8_gathered_elements
    from megatron_lite.validation import validate

    config, world, overrides = QUICKSTART
    z3 = [*overrides, "parallel.zero_stage=3"]
    fp8 = _dry_run(config, world, z3)
    bf16 = _dry_run(config, world, [*z3, "model.fp8_all_gather=false"])
    cfg = validate(with_vocab(load_config(config, z3)), world)
    n = cfg.parallel.dp * cfg.parallel.cp  # the shard group: each gather sends 1/n
    for a, b in zip(fp8, bf16, strict=True):
        pp = a["coords"]["pp"]
        saved = b["comm"]["comm_bytes/all_gather_fsdp"] - a["comm"]["comm_bytes/all_gather_fsdp"]
        gathers = 2 * a["microbatches"]  # each layer: in its forward and again in its backward
        want = gathers * fp8_gathered_elements(cfg, pp) / n
        assert want > 0 and saved == want, f"pp rank {pp}: saved {saved} bytes, formula {want}"


# the quickstart's layer at tp2 (h 256, 8 heads of 32, 4 KV groups, gated ffn 704): qkv
# [(8 + 2·4)·32/2, 256], proj [256, 256/2], fc1 [2·704/2, 256], fc2 [256, 704/2]; 2 layers a
# pipeline rank, every dim a multiple of 16
QUICKSTART_FP8 = 2 * (256 * 256 + 256 * 128 + 704 * 256 + 256 * 352)


def test_zero3_fp8_gather_time_moves_one_byte_per_fp8_weight_element():
    """The step time's ZeRO-3 weight gathers (plan/step_time.py, no overlap: all exposed)
    shrink by the FP8-gathered weights' saved byte an element: 2 gathers a microbatch × M ×
    the ring's (n-1)/n of it, over the dp link's bandwidth (NVLink in one node of 8)."""
    from megatron_lite.config import load_config
    from megatron_lite.plan.__main__ import with_vocab
    from megatron_lite.plan.hardware import get_gpu
    from megatron_lite.plan.peak import fp8_gathered_elements
    from megatron_lite.plan.step_time import step_time
    from megatron_lite.validation import validate

    config, world, overrides = QUICKSTART
    z3 = [*overrides, "parallel.zero_stage=3", "parallel.overlap_grad_reduce=false"]
    gpu = get_gpu("h100")
    dp = {}
    for flag in ("true", "false"):
        cfg = validate(with_vocab(load_config(config, [*z3, f"model.fp8_all_gather={flag}"])), 8)
        dp[flag] = step_time(cfg, world, gpu, 0.45, 8).dp
    assert fp8_gathered_elements(cfg, 0) == 0  # fp8_all_gather=false
    cfg = validate(with_vocab(load_config(config, z3)), 8)
    assert fp8_gathered_elements(cfg, 0) == fp8_gathered_elements(cfg, 1) == QUICKSTART_FP8
    m, n = 16 // (2 * 2), 2  # microbatches a step (global 16, micro 2, dp 2), the dp group
    want = 2 * m * (n - 1) / n * QUICKSTART_FP8 / (gpu.nvlink_gbps * 1e9)
    got = dp["false"] - dp["true"]
    assert got == pytest.approx(want, rel=1e-9), (got, want)
