"""Loss parity of TP, SP, DP and TP×DP against a single rank of the same seed (20 steps, fp32)."""

import pytest

from tests.parallel.parity import max_rel_diff, reference_losses, train_losses

LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "dp2": (2, []),
    "tp2_dp2_sp": (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
}
MODELS = {
    "llama": ["model.arch=llama"],
    "llama_untied": ["model.arch=llama", "model.tie_embeddings=false"],
    "gpt": ["model.arch=gpt"],
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_parity(layout, model, tmp_path):
    world, overrides = LAYOUTS[layout]
    ref = reference_losses(tuple(MODELS[model]))
    got = train_losses(world, MODELS[model] + overrides, str(tmp_path))
    assert ref[-1] < ref[0] - 0.1, f"reference loss did not fall: {ref}"
    diff = max_rel_diff(got, ref)
    print(f"PARITY {layout} {model}: max rel diff {diff:.2e}")
    assert diff < 1e-4, f"{layout}/{model}: max relative loss difference {diff:.2e}\n{got}\n{ref}"
