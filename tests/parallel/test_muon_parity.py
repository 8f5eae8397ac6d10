"""train.optimizer=muon: loss parity of the layouts that cut a Muon matrix (TP shards gathered
for Newton–Schulz, ZeRO-1/2 whole-parameter owners, ZeRO-3/HSDP gathered to an owner, pipeline
stages, expert stacks over EP) against a single rank of the same seed (6 steps, fp32, the tiny
untied Llama), and the mistakes those bounds catch.

Why fp32 Newton–Schulz and a later bound of MUON_LATER (1e-5, 10x tighter than the suite's
LATER): Muon's mistakes move a 6-step loss little. Measured against one rank: NS on each TP
shard (tp2+SP) 2.4e-4, no Nesterov 1.8e-4, fused q/k/v as one matrix 2.6e-4, the "original"
scale 1.6e-3 (relative, the worst later loss), so LATER would catch them by only ~2x. With
muon_ns_dtype=fp32 the layouts differ from one rank by 0 to 2e-8 (step 1 <= 9e-9), 500x under
MUON_LATER and each mistake >= 18x over it. bf16 NS (the default) rounds that noise up to
~3e-6 (bf16 NS vs fp32 NS alone: 2.1e-6), so the default-dtype cases hold the suite's LATER.
"""

import tempfile

import pytest

from tests.dist_harness import run_ranks
from tests.parallel.parity import (
    SHORT,
    TINY,
    assert_parity,
    max_rel_diff,
    reference_losses,
    structured_dataset,
    train_losses,
)
from tests.parallel.test_moe import MOE

MUON_LATER = 1e-5
MUON = ["train.optimizer=muon", *SHORT]
FP32 = ["train.muon_ns_dtype=fp32"]
MODELS = {
    "llama": ["model.arch=llama", "model.tie_embeddings=false", *MUON, *FP32],
    "moe": [*MOE, *MUON, *FP32],
    "llama_bf16": ["model.arch=llama", "model.tie_embeddings=false", *MUON],
    "moe_bf16": [*MOE, *MUON],
    # embedding and output stepped by Muon too, their vocabulary padded by TP (250 -> 252 on
    # one rank, 256 on tp2): Muon's scale is the logical matrix's (before the fix, 5.8e-5 off)
    "llama_vocab": [
        "model.arch=llama",
        "model.tie_embeddings=false",
        *MUON,
        *FP32,
        "train.muon_params=[attention,mlp,hidden,embedding,output]",
        "model.make_vocab_size_divisible_by=4",
    ],  # fmt: skip
}
TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
# (world, model, layout overrides)
LAYOUTS = {
    "tp2_sp": (2, "llama", TP2_SP),
    "dp2_zero1": (2, "llama", ["parallel.zero_stage=1"]),
    "ep2_zero3": (2, "moe", ["parallel.ep=2", "parallel.zero_stage=3"]),
    "dp2_zero2": (2, "llama", ["parallel.zero_stage=2"]),
    "dp2_zero3": (2, "llama", ["parallel.zero_stage=3"]),
    "pp2": (2, "llama", ["parallel.pp=2"]),
    "tp2_pp2_dp2_zero1": (
        8,
        "llama",
        ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1"],
    ),  # fmt: skip
    "ep2": (2, "moe", ["parallel.ep=2"]),
    "hsdp_dp4_shard2": (4, "llama", ["parallel.zero_stage=3", "parallel.dp_shard=2"]),
    # TP peers of a ZeRO-3 owner gather the same matrix over TP (the owners agree across TP)
    "tp2_dp2_sp_zero3": (4, "llama", [*TP2_SP, "parallel.zero_stage=3"]),
    "ep2_tp2_sp_zero3": (4, "moe", ["parallel.ep=2", *TP2_SP, "parallel.zero_stage=3"]),
    "tp2_sp_vocab_padded": (2, "llama_vocab", TP2_SP),
    # the default bf16 NS: the same code on another dtype, to the suite's own bounds
    "tp2_sp_bf16": (2, "llama_bf16", TP2_SP),
    "ep2_zero3_bf16": (2, "moe_bf16", ["parallel.ep=2", "parallel.zero_stage=3"]),
}
FAST = ("tp2_sp", "dp2_zero1")  # the fast suite is over budget: two cheap ones
CASES = [pytest.param(k, marks=[pytest.mark.parity]) for k in FAST] + [
    pytest.param(k, marks=[pytest.mark.slow, pytest.mark.parity]) for k in LAYOUTS if k not in FAST
]


@pytest.mark.parametrize("layout", CASES)
def test_muon_loss_parity(layout, tmp_path):
    world, model, overrides = LAYOUTS[layout]
    ref = reference_losses(tuple(MODELS[model]))
    assert ref[-1] < ref[0] - 0.05, f"reference loss did not fall with Muon: {list(ref)}"
    got = train_losses(world, MODELS[model] + overrides, str(tmp_path), timeout=300)
    later = MUON_LATER if "bf16" not in model else None
    assert_parity(got, ref, f"muon {layout} {model}", **({"later": later} if later else {}))


def per_shard_train(rank, world, overrides, out_dir):
    """The trainer with Muon's TP gather skipped: each TP rank runs NS (and the scale) on its
    own shard, as if it were the whole matrix (the mistake the gather prevents)."""
    from megatron_lite.parallel.data_parallel import muon
    from tests.parallel.parity import _train

    muon.tp_size = lambda meta: 1  # this forked rank only
    return _train(rank, world, overrides, out_dir)


# (what goes wrong, world, function, overrides; measured worst later loss vs one rank)
MISTAKES = {
    "ns_per_tp_shard": (2, per_shard_train, TP2_SP),  # 2.4e-4
    "no_nesterov": (1, None, ["train.muon_nesterov=false"]),  # 1.8e-4
    "original_scale": (1, None, ["train.muon_adjust_lr=original"]),  # 1.6e-3
    "fused_as_one": (1, None, ["train.muon_split_fused=false"]),  # 2.6e-4
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", MISTAKES)
def test_muon_mistakes_fall_outside_the_parity_bound(mistake):
    """Each mistake (a layout that skips the TP gather; the wrong Nesterov, scale or fused
    rule) puts the losses >= 10x MUON_LATER from the right one-rank run: the table's bound
    would catch it."""
    world, fn, overrides = MISTAKES[mistake]
    ref = reference_losses(tuple(MODELS["llama"]))
    if fn is None:
        got = reference_losses(tuple(MODELS["llama"] + overrides))
    else:
        args = [*TINY, f"data.paths=[{structured_dataset()}]", *MODELS["llama"], *overrides]
        with tempfile.TemporaryDirectory() as tmp:
            got = run_ranks(world, fn, args, tmp, timeout=300)[0]
    diff = max_rel_diff(got, ref)
    print(f"MUON mistake {mistake}: worst loss {diff:.1e} off ({diff / MUON_LATER:.0f}x bound)")
    assert diff > 10 * MUON_LATER, f"{mistake} is only {diff:.1e} from the right run"
