"""Measured memory (SavedTensorMeter and the trainer's model-state walk, one real training step
on gloo ranks) against the planner's formulas for our model (kernels="torch": the CPU runs the
plain-torch references): bytes per layer and the stage's saved peak to the byte, model states
within 2%, on 17 layouts (every CP type)."""

import functools
import tempfile

import pytest

from megatron_lite.config import load_config
from megatron_lite.plan.measure import measure_on_rank, one_step_config, predicted_layer
from megatron_lite.plan.memory import model_states, saved_activations
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
FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform",
        "model.recompute_num_layers=1"]  # fmt: skip
BF16 = ["train.precision=bf16"]
GPT = ["model.arch=gpt"]
CASES = {
    "tp1-fp32-none": (1, []),
    "tp1-bf16-selective": (1, BF16 + SEL),
    "gpt-fp32-none": (1, GPT),
    "gpt-bf16-selective": (1, GPT + BF16 + SEL),
    "tp2sp-bf16-none": (2, TP2 + BF16),
    "tp2sp-fp32-selective": (2, TP2 + SEL),
    "tp1-fp32-full": (1, FULL),
    "tp2sp-bf16-full": (2, TP2 + BF16 + FULL),
    "cp2-fp32-full": (2, ["parallel.cp=2"] + FULL),
    "tp2-nosp-fp32-none": (2, ["parallel.tp=2"]),
    "cp2-fp32-none": (2, ["parallel.cp=2"]),
    "cp2-bf16-selective": (2, ["parallel.cp=2"] + BF16 + SEL),
    # ring attention: fp32 accumulator and lse, its q, k, v (v keeps the qkv output)
    "cp2-p2p-fp32-none": (2, ["parallel.cp=2", "parallel.cp_comm_type=p2p"]),
    "cp2-p2p-bf16-selective": (2, ["parallel.cp=2", "parallel.cp_comm_type=p2p"] + BF16 + SEL),
    "cp4-a2a+p2p-bf16-none": (
        4,
        ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.cp_a2a_size=2"] + BF16,
    ),  # fmt: skip
    "pp2-fp32-none": (2, ["parallel.pp=2", "train.global_batch_size=4"]),
    "dp2-zero1-bf16-none": (2, ["parallel.zero_stage=1", "train.global_batch_size=4"] + BF16),
    # ZeRO-3, 2 microbatches per rank: the unsharded gradients kept between them (step), or
    # not (zero3_grad_reduce=microbatch: the fp32 shards only)
    "dp2-zero3-step-bf16": (2, ["parallel.zero_stage=3", "train.global_batch_size=8"] + BF16),
    "dp2-zero3-per-microbatch-bf16": (
        2,
        [
            "parallel.zero_stage=3",
            "train.global_batch_size=8",
            "parallel.zero3_grad_reduce=microbatch",
        ]
        + BF16,
    ),
}


def _config(world, overrides, out_dir):
    return one_step_config(validate(load_config(None, TINY + overrides), world), out_dir)


def _measure_all(rank, world, cases, out_dir):
    """Every case of this world size in one launch (a launch costs seconds on 2 cores)."""
    return {c: measure_on_rank(_config(world, CASES[c][1], f"{out_dir}/{c}")) for c in cases}


@functools.cache
def measured(world: int) -> list[dict]:
    """{case: result} per rank, every case of this world size in one launch."""
    cases = tuple(c for c, (w, _) in CASES.items() if w == world)
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(world, _measure_all, cases, tmp, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_measured_activations_and_states_match_the_formulas(case):
    """Per layer and microbatch, the stage's saved peak (in-flight microbatches, embedding,
    logits and loss) and the model states, on every pipeline rank."""
    world, overrides = CASES[case]
    cfg = _config(world, overrides, "")
    for res in (rank[case] for rank in measured(world)):
        where = f"{case} pp rank {res['pp_rank']}"
        layers = sorted(res["layers"].items())
        # full recompute: a layer saves nothing inside its checkpoint, only the group's input
        # (held before the layer starts, so it shows in the stage's peak, not per layer)
        full = cfg.model.recompute_granularity == "full"
        assert len(layers) == (0 if full else cfg.model.num_layers // cfg.parallel.pp), where
        want = predicted_layer(cfg, "torch")
        for label, got in layers:  # to the byte
            assert got / res["microbatches"] == want, f"{where} {label}: {got} vs {want}"
        want = saved_activations(cfg, world, res["pp_rank"], "torch")
        assert res["peak"] == want, f"{where} saved peak: {res['peak']} vs {want}"
        for k, v in model_states(cfg, res["pp_rank"]).items():
            assert res["states"][k] == pytest.approx(v, rel=0.02), f"{where} {k}"
