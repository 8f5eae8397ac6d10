"""Loss parity of TP, SP, DP and TP×DP against a single rank of the same seed (6 steps, fp32)."""

import pytest

from tests.parallel.parity import SHORT, assert_parity, max_rel_diff, reference_losses, train_losses

LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "dp2": (2, []),
    "tp2_dp2_sp": (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
}
MODELS = {
    "llama": ["model.arch=llama", *SHORT],
    "llama_untied": ["model.arch=llama", "model.tie_embeddings=false", *SHORT],
    "gpt": ["model.arch=gpt", *SHORT],
}


# each layout on the models it can break, not every product: the vocabulary-parallel output
# layer (tied or not) under TP, GPT's biases and LayerNorm under SP, the full 2-D layout on both
# (DP alone is covered again by every ZeRO stage in test_zero.py / test_zero3.py)
CASES = [
    ("tp2", "llama"),
    ("tp2", "llama_untied"),
    ("tp2_sp", "gpt"),
    ("dp2", "llama_untied"),
    ("tp2_dp2_sp", "llama"),
    ("tp2_dp2_sp", "gpt"),
]


@pytest.mark.parity
@pytest.mark.parametrize("layout,model", CASES)
def test_loss_parity(layout, model, tmp_path):
    world, overrides = LAYOUTS[layout]
    ref = reference_losses(tuple(MODELS[model]))
    got = train_losses(world, MODELS[model] + overrides, str(tmp_path))
    assert ref[-1] < ref[0] - 0.05, f"reference loss did not fall: {ref}"
    assert_parity(got, ref, f"{layout} {model}")


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_bf16_autocast_tracks_fp32(model, tmp_path):
    """bf16 autocast on tp=2 with SP follows the fp32 single-rank curve to bf16 rounding."""
    ref = reference_losses(tuple(MODELS[model]))
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16"]
    got = train_losses(2, MODELS[model] + layout, str(tmp_path))
    diff = max_rel_diff(got, ref)
    print(f"BF16 {model}: max rel diff vs fp32 {diff:.2e}")
    assert diff < 5e-3, f"bf16 run drifts from fp32: {got} vs {ref}"
