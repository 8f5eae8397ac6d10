"""Local FP8 (model.fp8=tensorwise|rowwise): the keys' rules and errors, which layers a model
puts in FP8, and the experts' FP8 grouped GEMM within the rowwise rounding bound."""

import pytest
import torch

from megatron_lite.config import ConfigError, load_config
from megatron_lite.validation import validate
from tests.parallel.test_fp8 import E4M3, _gemm_bound

pytest.importorskip("torchao.float8")

BASE = ["data.mock=true", "model.vocab_size=64", "train.precision=bf16"]


def _validate(*overrides):
    return validate(load_config(None, [*BASE, *overrides]), 1)


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["model.fp8=tensorwise", "train.precision=fp32"], "set train.precision=bf16"),
        (["model.fp8=rowwise", "model.linear_backend=te"], "model.linear_backend=local"),
        (["model.fp8=hybrid"], "model.linear_backend=te with model.fp8=hybrid|e4m3"),
        (["model.fp8=tensorwise", "model.fp8_unaligned=pad"], "one of"),
        (["model.fp8=tensorwise", "model.seq_length=20"], "seq_length/cp × micro_batch_size"),
    ],
)
def test_local_fp8_config_errors_name_key_rule_and_fix(overrides, rule):
    with pytest.raises(ConfigError) as e:
        _validate(*overrides)
    assert "model.fp8" in str(e.value) and rule in str(e.value) and "Fix:" in str(e.value)


def _chunk(*overrides):
    from megatron_lite.models.chunk import ModelChunk
    from megatron_lite.models.transformer_config import TransformerConfig
    from megatron_lite.parallel.random import RNGStatesTracker
    from megatron_lite.plan.modules import fake_mesh

    cfg = _validate("model.num_layers=1", *overrides)
    config = TransformerConfig.from_config(cfg, 1)
    with fake_mesh(1) as mesh, torch.device("meta"):
        return ModelChunk(config, mesh, RNGStatesTracker(), [0], True, True)


def test_fp8_layers_skip_the_output_layer_and_unaligned_widths():
    from megatron_lite.parallel.fp8 import Fp8Gemm

    sizes = ["model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=72"]
    chunk = _chunk("model.fp8=tensorwise", *sizes)
    fp8 = {n for n, m in chunk.named_modules() if isinstance(getattr(m, "fp8", None), Fp8Gemm)}
    # fc1 [2·72, 64] is aligned, fc2 [64, 72] is not (72 % 16): fc2 and the output layer bf16
    attention = {f"layers.0.self_attention.linear_{n}" for n in ("qkv", "proj")}
    assert fp8 == attention | {"layers.0.mlp.linear_fc1"}, fp8
    with pytest.raises(ValueError, match=r"model.fp8_unaligned=error.*multiples of 16.*Fix:"):
        _chunk("model.fp8=tensorwise", "model.fp8_unaligned=error", *sizes)


def _check(name, got, a, b):
    """got ≈ a·b within the rowwise E4M3 bound (scales along the contraction), and FP8 really
    ran: its mean error ≥ 3× the bf16 GEMM's (measured 10-17×)."""
    exact = a.double() @ b.double()
    err = (got.double() - exact).abs()
    bound = _gemm_bound(a, b, E4M3, E4M3, -1, 0, got)
    assert (err <= bound).all(), f"{name}: error exceeds the rowwise FP8 bound"
    bf16 = (a.bfloat16() @ b.bfloat16()).double()
    assert err.mean() > 3 * (bf16 - exact).abs().mean(), f"{name}: not FP8"


def test_experts_fp8_grouped_gemm_and_its_gradients_within_the_rowwise_bound():
    from megatron_lite.moe.fp8_grouped import fp8_grouped_mm

    torch.manual_seed(0)
    sizes, a, b = [5, 0, 27, 16], 32, 48
    x = torch.randn(sum(sizes), a).bfloat16().requires_grad_()
    w = (torch.randn(len(sizes), b, a) * 0.05).requires_grad_()  # [G, b, a] as the experts'
    dy = torch.randn(sum(sizes), b).bfloat16()
    offsets = torch.tensor(sizes).cumsum(0, dtype=torch.int32)
    y = fp8_grouped_mm(x, w.transpose(1, 2), offsets)  # [N, b]
    y.backward(dy)
    blocks = zip(x.detach().split(sizes), dy.split(sizes), y.detach().split(sizes), strict=True)
    for g, (xe, dye, ye) in enumerate(blocks):
        if not len(xe):
            assert not w.grad[g].any(), f"expert {g} has no rows but a gradient"
            continue
        _check(f"expert {g} forward", ye, xe, w[g].detach().t())
        _check(f"expert {g} wgrad", w.grad[g].t(), xe.t(), dye)  # [a, b] = x_gᵀ · dy_g
    for g, (dxe, dye) in enumerate(zip(x.grad.split(sizes), dy.split(sizes), strict=True)):
        if len(dye):
            _check(f"expert {g} dgrad", dxe, dye, w[g].detach())


def test_keys_of_the_other_fp8_family_warn_that_they_have_no_effect():
    from megatron_lite.validation.inactive import config_warnings

    local = config_warnings(_validate("model.fp8=tensorwise", "model.fp8_recipe=delayed"))
    assert any("model.fp8_recipe" in w and "its own recipe" in w for w in local), local
    off = config_warnings(
        _validate("model.fp8_skip=[mlp]", "model.fp8_unaligned=error", "model.fp8_all_gather=false")
    )
    keys = ("model.fp8_skip", "model.fp8_unaligned", "model.fp8_all_gather")
    assert sum(any(k in w for k in keys) for w in off) == 3, off


def test_fp8_gather_weight_is_its_fp32_shard_to_every_op_and_to_a_checkpoint():
    """Fp8GatherWeight (ZeRO-3's FP8 gather) keeps its form through the ops FSDP2 shards it
    with, computes as the plain tensor inside, and pickles as that tensor (a checkpoint holds
    values, not the wrapper and its process group); wrap_fp8_weights wraps tensorwise FP8
    linears only, keeping the weight's metadata."""
    import io

    from megatron_lite.models.fp8 import apply_fp8
    from megatron_lite.parallel.data_parallel.fsdp_fp8 import Fp8GatherWeight, wrap_fp8_weights
    from megatron_lite.parallel.layers import ColumnParallelLinear

    for recipe, gather, wrapped in (("tensorwise", True, 1), ("rowwise", True, 0),
                                    ("tensorwise", False, 0)):  # fmt: skip
        fc = ColumnParallelLinear(32, 48, None, bias=False)
        apply_fp8(torch.nn.ModuleList([fc]), recipe, [], all_gather=gather)
        assert wrap_fp8_weights(fc) == wrapped, (recipe, gather)
    fc = ColumnParallelLinear(32, 48, None, bias=False)
    with torch.no_grad():  # the layer's storage is uninitialized (NaN would fail equal below)
        fc.weight.normal_()
    meta = fc.weight.meta
    apply_fp8(torch.nn.ModuleList([fc]), "tensorwise", [], all_gather=True)
    wrap_fp8_weights(fc)
    w = fc.weight
    assert isinstance(w.data, Fp8GatherWeight) and w.meta is meta
    rows = w.detach()[8:24].view(-1)  # FSDP2's slice and view keep it
    assert isinstance(rows, Fp8GatherWeight)
    plain = w._tensor
    assert torch.equal(w.detach() * 2, plain * 2) and type(w.detach() * 2) is torch.Tensor
    buf = io.BytesIO()
    torch.save(rows.to(torch.bfloat16), buf)
    buf.seek(0)
    got = torch.load(buf)
    assert type(got) is torch.Tensor and torch.equal(got, plain[8:24].reshape(-1).bfloat16())
