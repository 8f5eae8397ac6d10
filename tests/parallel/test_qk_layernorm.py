"""model.qk_layernorm (Qwen3's per-head q/k RMSNorm) and model.kv_channels (a head dimension with
heads·head_dim != hidden_size) on several ranks: loss and gradient-norm parity against a single
rank (6 steps, fp32). The norm weights [head_dim] are replicated over TP while each TP rank
normalizes different heads, so their gradients must be summed over TP even without sequence
parallelism; a missing sum shows in step 1's gradient norm and in the later losses."""

import pytest

from tests.parallel.parity import SHORT, assert_parity, reference_losses, train_losses

# 4 heads of width 24: q = 96 != hidden 64
QK = ["model.qk_layernorm=true", "model.kv_channels=24", *SHORT]
GPT = ["model.arch=gpt"]  # LayerNorm q/k norms: weight and bias summed over TP
LAYOUTS = {
    "tp2": (2, [], ["parallel.tp=2"]),
    "cp2": (2, [], ["parallel.cp=2"]),
    "gpt_tp2": (2, GPT, ["parallel.tp=2"]),
}


@pytest.mark.parity
@pytest.mark.parametrize("layout", LAYOUTS)
def test_qk_layernorm_loss_parity(layout, tmp_path):
    world, model, parallel = LAYOUTS[layout]
    ref = reference_losses(tuple(QK + model))
    assert ref[-1] < ref[0] - 0.1, f"reference loss did not fall: {list(ref)}"
    got = train_losses(world, [*QK, *model, *parallel], str(tmp_path))
    assert_parity(got, ref, f"qk_layernorm {layout}")


def test_qk_layernorm_changes_the_model():
    """The switch and the head width reach the model: its losses differ from the plain one's."""
    plain = reference_losses(tuple(SHORT))
    qk = reference_losses(tuple(QK))
    assert abs(qk[0] - plain[0]) > 1e-4 or abs(qk[-1] - plain[-1]) > 1e-4, (list(qk), plain)
