"""The planner counts local FP8 (model.fp8=tensorwise): its layers' working sets and saved
bytes are measured on a layer with the FP8 GEMMs (plan/saved.py), and under ZeRO-3 with
model.fp8_all_gather the gathered FP8 weights take 1 byte an element (plan/peak.py). Checked
against the dry run of the real step (fake tensors, torchao's casts included), within the
planner-vs-dry-run tolerance of tests/unit/test_dry_run_planner.py, on the quickstart layout
(tp2 pp2 dp2, ZeRO-1) and on it under ZeRO-3; and the dry run's FSDP all-gather bytes fall
by one byte per FP8-gathered element per gather (plan/peak.py fp8_gathered_elements, which
the step time's ZeRO-3 gather uses)."""

import pytest

from tests.unit.test_dry_run_planner import TOLERANCE, _dry_run

pytest.importorskip("torchao.float8")

QUICKSTART = ("configs/quickstart.yaml", 8, ["model.fp8=tensorwise", "train.precision=bf16"])


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
