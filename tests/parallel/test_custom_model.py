"""A model we did not write (tests/parallel/custom_model.py) trains through the public building
blocks and the pipeline engine, and matches its own single-rank run on tp2+SP × pp2 (vpp2) ×
dp2 with ep2."""

import os
import subprocess
import sys

import pytest

from tests.dist_harness import run_ranks
from tests.parallel import custom_model
from tests.parallel.parity import assert_parity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_building_blocks_need_no_config():
    """Importing everything the custom model uses does not import megatron_lite.config (a
    fresh interpreter: the test ranks' fork server has the trainer preloaded)."""
    check = (
        "import sys, tests.parallel.custom_model; assert 'megatron_lite.config' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parity
def test_custom_model_matches_single_rank():
    reference = run_ranks(1, custom_model.train, 1, 1, 1, 1, timeout=120)[0]
    # world 8 = tp2 · pp2 · dp2; experts over ep2 inside dp; two chunks per pipeline rank
    layout = run_ranks(8, custom_model.train, 2, 2, 2, 2, timeout=180)[0]
    assert reference[-1] < reference[0] - 0.05, f"the model does not learn: {reference}"
    print(f"custom model: {reference[0]:.3f} -> {reference[-1]:.3f}")
    assert_parity(layout, reference, "custom model tp2+SP pp2 vpp2 ep2")
