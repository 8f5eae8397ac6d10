"""Measured activation bytes per layer (SavedTensorMeter, one real training step on gloo ranks)
against the planner's formula for our model (kernels="torch": the CPU runs the plain-torch
references), within 5%; and the measured model states against memory.formula_bytes."""

import functools
import tempfile

import pytest

from megatron_lite.config import load_config
from megatron_lite.plan.measure import measure_on_rank, one_step_config, predicted_layers
from megatron_lite.plan.memory import model_states
from megatron_lite.validation import validate
from tests.dist_harness import run_ranks

TINY = [
    "model.vocab_size=256", "model.num_layers=2", "model.hidden_size=64",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=128",
    "model.seq_length=32", "data.mock=true", "train.micro_batch_size=2",
    "train.global_batch_size=2",
]  # fmt: skip
TP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
SEL = ["model.recompute_granularity=selective"]
BF16 = ["train.precision=bf16"]
CASES = {
    "tp1-fp32-none": (1, []),
    "tp1-bf16-selective": (1, BF16 + SEL),
    "tp2sp-bf16-none": (2, TP2 + BF16),
    "tp2sp-fp32-selective": (2, TP2 + SEL),
    "cp2-fp32-none": (2, ["parallel.cp=2"]),
    "cp2-bf16-selective": (2, ["parallel.cp=2"] + BF16 + SEL),
}


def _config(world, overrides, out_dir):
    return one_step_config(validate(load_config(None, TINY + overrides), world), out_dir)


def _measure_all(rank, world, cases, out_dir):
    """Every case of this world size in one launch (a launch costs seconds on 2 cores)."""
    return {c: measure_on_rank(_config(world, CASES[c][1], f"{out_dir}/{c}")) for c in cases}


@functools.cache
def measured(world: int) -> dict:
    cases = tuple(c for c, (w, _) in CASES.items() if w == world)
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(world, _measure_all, cases, tmp, timeout=120)[0]


@pytest.mark.parametrize("case", CASES)
def test_measured_activations_per_layer_match_the_formula(case):
    world, overrides = CASES[case]
    res = measured(world)[case]
    cfg = _config(world, overrides, "")
    assert len(res["layers"]) == cfg.model.num_layers
    for i, (label, got) in enumerate(sorted(res["layers"].items())):
        want = predicted_layers(cfg, "torch", first=i == 0)
        assert got == pytest.approx(want, rel=0.05), f"{case} {label}: {got} vs {want}"
    for k, v in model_states(cfg, 0).items():
        assert res["states"][k] == pytest.approx(v, rel=0.02), f"{case} {k}"
