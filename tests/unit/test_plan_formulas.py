"""The planner's formulas against published figures: Korthikanti et al. 2022 (activations per
layer), the ZeRO paper's example (model states), and the schedule simulator (in-flight
microbatches)."""

import pytest

from megatron_lite.config import load_config
from megatron_lite.parallel.data_parallel.memory import formula_bytes
from megatron_lite.pipeline.schedules import get_schedule_table, in_flight, simulate_options
from megatron_lite.pipeline.simulate import simulate
from megatron_lite.plan.hardware import get_gpu
from megatron_lite.plan.search import search
from tests.plan_reference import (
    LayerShape,
    korthikanti,
    layer_input_bytes,
    layer_terms,
    selective,
)

SIZES = [
    (2048, 1, 12288, 96, 8),
    (1024, 4, 4096, 32, 2),
    (4096, 2, 8192, 64, 4),
    (512, 8, 2048, 16, 1),
]


def paper(s, b, h, a, t, sp=False):
    """Their GPT: fp16 everywhere, dropout masks, attention scores materialized, f = 4h."""
    return LayerShape(s, b, h, a, a, 4 * h, arch="paper", tp=t, sp=sp and t > 1, act_bytes=2,
                      residual_bytes=2, dropout=True)  # fmt: skip


@pytest.mark.parametrize("s,b,h,a,t", SIZES)
def test_engine_reproduces_korthikanti_table_2(s, b, h, a, t):
    none = sum(layer_terms(paper(s, b, h, a, 1)).values())
    assert none == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)
    assert none == pytest.approx(korthikanti(s, b, h, a, 1, "none"), rel=1e-12)
    tp = sum(layer_terms(paper(s, b, h, a, t)).values())
    assert tp == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    sel = sum(selective(layer_terms(paper(s, b, h, a, t, sp=True)), ["core_attn"]).values())
    expected = 34 * s * b * h / t if t > 1 else s * b * h * 34
    assert sel == pytest.approx(expected, rel=1e-12)
    assert layer_input_bytes(paper(s, b, h, a, t)) == pytest.approx(2 * s * b * h, rel=1e-12)


def test_zero_paper_example_through_memory_formulas():
    """Ψ = 7.5B, N_d = 64, K = 12 (fp16 weights and grads, fp32 master + Adam): 120, 31.4,
    16.6, 1.9 GB. Our table keeps fp32 grads (4 bytes, not their 2), so the ZeRO figures are
    formula_bytes with their 2-byte gradients: weights + grads/N^(stage≥2) + K/N."""
    psi, n = 7.5e9, 64
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        ours = formula_bytes(psi, "bf16", min(stage, 2), n)
        k_share = ours["master"] + ours["optimizer"]  # 12/N (stage ≥ 1) or 12
        grads = 2 * psi / (n if stage >= 2 else 1)  # the paper's fp16 gradients
        weights = 2 * psi / (n if stage == 3 else 1)
        if stage == 3:
            k_share = 12 * psi / n
        total = (weights + grads + k_share) / 1e9
        assert total == pytest.approx(gb, abs=0.06), (stage, total)
    # our fp32 gradients: 18 bytes per parameter at stage 0 (Megatron's figure), 6 + 12/N at 1
    assert sum(formula_bytes(psi, "bf16", 0, n).values()) == 18 * psi
    assert sum(formula_bytes(psi, "bf16", 1, n).values()) == pytest.approx((6 + 12 / n) * psi)


@pytest.mark.parametrize(
    "pp,vpp,m,schedule",
    [(4, 1, 8, None), (4, 1, 4, None), (4, 2, 8, None), (2, 3, 4, None), (8, 2, 16, None),
     (4, 1, 7, "zb-h1"), (4, 2, 4, "zb-v"), (4, 2, 5, "zb-v"), (8, 2, 24, "zb-v"),
     (2, 2, 4, "dualpipev"), (4, 2, 9, "dualpipev"), (8, 2, 16, "dualpipev")],
)  # fmt: skip
def test_in_flight_matches_the_schedule_simulator(pp, vpp, m, schedule):
    table = get_schedule_table(pp, m, vpp, schedule)
    peak = simulate(table, **simulate_options(schedule, vpp)).peak_in_flight
    assert [in_flight(pp, vpp, m, r, schedule) for r in range(pp)] == list(peak)


@pytest.mark.slow  # the suite's budget: CI's slow tier runs it
def test_search_finds_a_fitting_70b_layout_on_64_h100():
    cfg = load_config("configs/llama3_70b.yaml")
    gpu = get_gpu("h100")
    best, counts = search(cfg, 64, gpu, 0.45, 8, top=2)
    assert counts.fit > 0 and best
    assert all(c.peak_bytes <= gpu.memory_bytes for c in best)
    assert best[0].time.tokens_per_s >= best[-1].time.tokens_per_s


@pytest.mark.parametrize(
    "layers,pp,vpp,ends",
    [
        (61, 16, 1, (3, 2)),  # DeepSeek-V3: 3 + 14·4 + 2, no equal ends exist
        (61, 8, 1, (7, 6)),
        (61, 2, 1, (31, 30)),  # two stages: the ends are the whole split
        (126, 16, 4, (1, 1)),  # equal ends where they exist (Llama-3 405B), as before
        (80, 4, 3, (5, 5)),
        (80, 4, 1, (None, None)),
        (61, 16, 2, None),  # 32 stages: ends one apart need 59 - 2·last divisible by 30
    ],
)
def test_search_splits_an_odd_layer_count_over_a_power_of_two_pipeline(layers, pp, vpp, ends):
    """The search's first/last stage layers: validate() accepts the split it proposes, so the
    search tries pipelines on DeepSeek-V3's 61 layers (before: no split, every pp > 1 skipped)."""
    from megatron_lite.plan.search import pipeline_split
    from megatron_lite.validation import validate

    assert pipeline_split(layers, pp * vpp) == ends
    if ends is None:
        return
    first, last = ends
    over = [f"model.num_layers={layers}", "model.num_attention_heads=4", "model.vocab_size=256",
            "data.mock=true", f"parallel.pp={pp}", f"parallel.vpp={vpp}",
            f"parallel.decoder_first_pipeline_num_layers={'null' if first is None else first}",
            f"parallel.decoder_last_pipeline_num_layers={'null' if last is None else last}",
            f"train.global_batch_size={2 * pp}"]  # fmt: skip
    if vpp > 1:
        over.append("parallel.pipeline_schedule=interleaved")
    validate(load_config(None, over), pp)


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 40), (4, 2, 40), (3, 1, 31), (8, 2, 40)])
def test_scaled_short_simulation_equals_the_full_one(pp, vpp, m):
    """step_time simulates 2·pp microbatches and scales the steady state: exact for m >= 2·pp."""
    from megatron_lite.plan.step_time import _simulated

    weights = tuple(float(w) for w in range(1, pp * vpp + 1))
    full = simulate(get_schedule_table(pp, m, vpp), 1.0, 2.5, 0.25, list(weights)).makespan
    assert _simulated(pp, vpp, m, weights, 1.0, 2.5, 0.25) == pytest.approx(float(full))


def test_megatron_theoretical_memory_agrees_for_gpt_and_differs_for_llama_as_documented():
    """Megatron-LM's per-layer s·b·h·(18 + 4f/h)/t is Korthikanti's 34·s·b·h/t for f = 4h; for
    Llama-3 70B (tp8+SP, selective, bf16) ours differs by SwiGLU's extra f-wide intermediate
    (+), GQA (qkv output and RoPE'd q, k instead of three h-wide Q, K, V: −), no dropout masks
    (−) and the norms' rstd (+)."""
    from megatron_lite.plan.activations import layer_bytes, layer_shape
    from tests.plan_reference import megatron_theoretical

    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert megatron_theoretical(s, b, h, 4 * h, t) == korthikanti(s, b, h, a, t, "tp_sp_selective")
    cfg = load_config("configs/llama3_70b.yaml", ["model.recompute_granularity=selective"])
    ours = sum(layer_bytes(cfg, layer_shape(cfg)).values())
    theirs = megatron_theoretical(8192, 1, 8192, 28672, 8)
    sbh_t = 8192 * 8192 / 8
    swiglu = 2 * 28672 / 8192 * sbh_t  # 2 bytes × f per token more
    attention = ((64 + 16) * 128 + (64 + 8) * 128) / 8192 * 2 * sbh_t - 6 * sbh_t
    masks = -2 * sbh_t
    rstd = 2 * 4 * 8192 / 8
    assert ours - theirs == pytest.approx(swiglu + attention + masks + rstd, rel=1e-12)


@pytest.mark.slow  # in CI's slow tier (bash tests/run.sh -m slow): keeps the suite under 10 min
def test_search_skipping_the_walk_changes_nothing(monkeypatch):
    """The search skips the schedule walk where the model states alone exceed the budget and
    cannot beat the smallest peak seen: its counts, smallest peak and finalists equal a search
    that walks every valid layout (the bound switched off)."""
    import megatron_lite.plan.search as search_module

    cfg = load_config("configs/mixtral_8x7b.yaml")  # nothing fits 4 H100: the smallest is named
    gpu = get_gpu("h100")
    calls = []
    walked = search_module.peak_bytes

    def counting(*args, **kwargs):
        calls.append(1)
        return walked(*args, **kwargs)

    monkeypatch.setattr(search_module, "peak_bytes", counting)
    pruned = search(cfg, 4, gpu, 0.45, 8, top=2)
    pruned_walks = len(calls)
    monkeypatch.setattr(search_module, "static_states", lambda cfg, rank: {"weights": 0.0})
    calls.clear()
    full = search(cfg, 4, gpu, 0.45, 8, top=2)
    assert pruned_walks < len(calls), (pruned_walks, len(calls))  # the bound did skip walks
    (best_p, counts_p), (best_f, counts_f) = pruned, full
    assert (counts_p.tried, counts_p.valid, counts_p.fit) == (counts_f.tried, counts_f.valid,
                                                               counts_f.fit)  # fmt: skip
    assert counts_p.smallest_peak == counts_f.smallest_peak and counts_p.smallest_peak
    assert counts_p.smallest == counts_f.smallest
    assert [c.overrides for c in best_p] == [c.overrides for c in best_f]


@pytest.mark.parametrize("pp,m", [(4, 40), (3, 31), (4, 9)])
def test_zb_h1_planner_pipeline_is_the_simulators(pp, m):
    """The planner's zb-h1 bubble: the short simulation scaled equals the full one, and with
    even stages the closed form (pp-1)(F+B-W) equals the simulator."""
    from megatron_lite.plan.step_time import _pipeline, _simulated

    weights = tuple(float(w) for w in range(1, pp + 1))
    table = get_schedule_table(pp, m, 1, "zb-h1")
    full = simulate(table, 1.0, 2.5, 0.25, list(weights), 1.0, comm="posted").makespan
    assert _simulated(pp, 1, m, weights, 1.0, 2.5, 0.25, "zb-h1", 1.0) == pytest.approx(full)
    even = (1.0,) * pp
    simulated = _pipeline(pp, 1, m, even, 1.0, 2.5, 0.0, True, "zb-h1", 1.0)[1]
    closed = _pipeline(pp, 1, m, even, 1.0, 2.5, 0.0, False, "zb-h1", 1.0)[1]
    assert simulated == pytest.approx(closed) == pytest.approx((pp - 1) * (1.0 + 1.5 - 1.0))


def test_zb_h1_planner_step_is_shorter_and_exposes_the_tp_scatter():
    """Llama-3 8B, tp2 x pp4, 16 microbatches on H100: zb-h1's bubble is below 1F1B's, and
    its TP backward exposes the reduce-scatter the deferred weight GEMM no longer hides."""
    from megatron_lite.plan.step_time import step_time

    layout = ["parallel.tp=2", "parallel.pp=4", "parallel.dp=1", "train.global_batch_size=16",
              "train.micro_batch_size=1"]  # fmt: skip
    one = step_time(load_config("configs/llama3_8b.yaml", layout), 8, get_gpu("h100"), 0.45, 8)
    zb = step_time(
        load_config("configs/llama3_8b.yaml", [*layout, "parallel.pipeline_schedule=zb-h1"]),
        8, get_gpu("h100"), 0.45, 8,
    )  # fmt: skip
    assert zb.bubble_fraction < one.bubble_fraction / 2 and zb.total < one.total
    assert zb.tp > one.tp and zb.compute == one.compute


def test_zb_v_planner_bubble_is_below_zb_h1_and_interleaved():
    """The same layout with two chunks per rank: ZB-V (the V placement, the simulator's table)
    leaves less bubble than ZB-H1 and than interleaved 1F1B, on the same compute."""
    from megatron_lite.plan.step_time import step_time

    layout = ["parallel.tp=2", "parallel.pp=4", "parallel.dp=1", "train.global_batch_size=16",
              "train.micro_batch_size=1"]  # fmt: skip
    times = {
        name: step_time(
            load_config("configs/llama3_8b.yaml", [*layout, *extra]), 8, get_gpu("h100"), 0.45, 8
        )  # fmt: skip
        for name, extra in {
            "zb-h1": ["parallel.pipeline_schedule=zb-h1"],
            "interleaved": ["parallel.vpp=2"],
            "zb-v": ["parallel.vpp=2", "parallel.pipeline_schedule=zb-v"],
        }.items()
    }
    zb_v = times["zb-v"]
    assert zb_v.bubble_fraction < times["zb-h1"].bubble_fraction / 2
    assert zb_v.bubble_fraction < times["interleaved"].bubble_fraction / 2
    assert zb_v.compute == times["zb-h1"].compute and zb_v.total < times["zb-h1"].total
