"""Training through the Triton kernels (interpreted on CPU) matches the torch path."""

import pytest

from tests.parallel.parity import max_rel_diff, train_losses

SHORT = ["model.num_layers=2", "train.steps=3", "model.seq_length=16"]
TRITON = {"MEGATRON_LITE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
TORCH = {"MEGATRON_LITE_KERNELS": "torch"}


@pytest.mark.slow  # in CI's slow tier (bash tests/run.sh -m slow): keeps the suite under 10 min
def test_triton_training_matches_torch(tmp_path):
    # tp=2 with SP exercises every kernel, the vocab-parallel loss across ranks included
    world, layout = 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]
    ref = train_losses(world, SHORT + layout, str(tmp_path / "torch"), env=TORCH)
    got = train_losses(world, SHORT + layout, str(tmp_path / "triton"), env=TRITON, timeout=400)
    diff = max_rel_diff(got, ref)
    print(f"PARITY triton vs torch {world} ranks {layout}: max rel diff {diff:.2e}")
    assert diff < 1e-5, f"Triton path diverges from torch: {got} vs {ref}"
