"""The shared expert (model.moe_shared_expert_ffn_hidden_size): the MoE layer's output is the
routed experts' combination plus a dense SwiGLU of every token (times its sigmoid gate with
model.moe_shared_expert_gate), checked against plain torch in float64; and the layer pattern
keys (moe_layer_freq as a list, moe_first_k_dense_replace)."""

import torch
import torch.nn.functional as F

from megatron_lite.config import load_config
from megatron_lite.models.transformer import MLP
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.moe import MoELayer
from megatron_lite.resolve import moe_layer_pattern, num_moe_layers

H, FFN, SHARED, E, K = 16, 8, 12, 4, 2


def _layer(shared: bool, gate: bool = False) -> MoELayer:
    cfg = load_config(
        None, ["model.hidden_size=16", "model.num_attention_heads=2", "model.vocab_size=64"]
    )
    c = TransformerConfig.from_config(cfg, 1) if shared else None
    torch.manual_seed(0)  # the same router and expert weights with and without the shared one
    shared_expert = MLP(c, None, SHARED) if shared else None
    layer = MoELayer(H, FFN, E, K, shared_expert=shared_expert, shared_expert_gate=gate)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.double()


def test_shared_expert_adds_a_dense_swiglu_of_every_token():
    with_shared, routed = _layer(True), _layer(False)
    routed.load_state_dict(
        {k: v for k, v in with_shared.state_dict().items() if "shared" not in k}, strict=True
    )
    x = torch.randn(5, 3, H, dtype=torch.float64, requires_grad=True)
    out = with_shared(x)
    w1 = with_shared.shared_expert.linear_fc1.weight  # [2·SHARED, H]: gate, up
    w2 = with_shared.shared_expert.linear_fc2.weight  # [H, SHARED]
    gate, up = (x @ w1.T).chunk(2, dim=-1)
    want = routed(x) + (F.silu(gate) * up) @ w2.T
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    assert w1.grad is not None and w1.grad.abs().sum() > 0  # the shared expert is trained


def test_shared_expert_gate_scales_it_by_a_sigmoid_per_token():
    """model.moe_shared_expert_gate (Qwen2-MoE): shared(x) · sigmoid(x·gᵀ), g [1, h], trained."""
    gated, ungated = _layer(True, gate=True), _layer(True)
    ungated.load_state_dict(
        {k: v for k, v in gated.state_dict().items() if k != "shared_expert_gate"}, strict=True
    )
    x = torch.randn(5, 3, H, dtype=torch.float64, requires_grad=True)
    out = gated(x)
    g = gated.shared_expert_gate  # [1, H]
    w1 = gated.shared_expert.linear_fc1.weight
    w2 = gated.shared_expert.linear_fc2.weight
    up_gate, up = (x @ w1.T).chunk(2, dim=-1)
    shared = (F.silu(up_gate) * up) @ w2.T  # [s, b, H]
    want = ungated(x) - shared + shared * torch.sigmoid(x @ g.T)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert g.shape == (1, H)
    out.square().sum().backward()
    assert g.grad is not None and g.grad.abs().sum() > 0  # the gate is trained


def test_layer_pattern_keys():
    base = ["model.num_layers=6", "model.num_experts=4"]
    every2 = load_config(None, [*base, "model.moe_layer_freq=2"]).model
    assert moe_layer_pattern(every2) == [True, False, True, False, True, False]
    listed = load_config(None, [*base, "model.moe_layer_freq=[0,0,1,1,0,1]"]).model
    assert moe_layer_pattern(listed) == [False, False, True, True, False, True]
    first3 = load_config(None, [*base, "model.moe_first_k_dense_replace=3"]).model
    assert moe_layer_pattern(first3) == [False] * 3 + [True] * 3  # DeepSeek-V3's first 3 dense
    assert num_moe_layers(first3) == 3
    dense = load_config(None, ["model.num_layers=6"]).model
    assert moe_layer_pattern(dense) == [False] * 6


def test_shared_expert_gate_gets_weight_decay_like_the_router():
    """The gate [1, h] is a matrix: AdamW's spec decays it as it does the router's [E, h] (and
    as Megatron's default rule, which exempts only biases and 1-D parameters, and HF Trainer's,
    which exempts biases and norms)."""
    from megatron_lite.parallel.data_parallel.optimizer_spec import ADAMW, make_optimizer

    layer = _layer(True, gate=True)
    named = dict(layer.named_parameters())
    hyper = {**ADAMW.hyperparameters, "weight_decay": 0.1}
    opt = make_optimizer(ADAMW, [(p, p, n) for n, p in named.items()], hyper, False)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert id(named["shared_expert_gate"]) in decayed
    assert id(named["router.weight"]) in decayed
