"""The optimizer registry and its rules (parallel/data_parallel/optimizer_spec.py): AdamW's
spec builds the torch AdamW the wrappers always built (same groups, bitwise the same step), a
spec with a per-tensor update steps as torch.optim.SGD does, and every bad spec, name or
hyperparameter is refused naming the argument (or key), the rule and a fix."""

import os

import pytest
import torch
from torch import nn

from megatron_lite.config import ConfigError, load_config
from megatron_lite.parallel.data_parallel import DataParallelArgumentError, build_data_parallel
from megatron_lite.parallel.data_parallel.optimizer_spec import (
    ADAMW,
    OptimizerSpec,
    ParamGroup,
    StateSpec,
    get_optimizer,
    make_optimizer,
    optimizer_names,
    register_optimizer,
    unregister_optimizer,
)
from megatron_lite.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "configs", "smoke.yaml")


def _sgd(param, grad, state, group) -> None:
    buf = state["momentum_buffer"]
    buf.mul_(group["momentum"]).add_(grad)
    param.add_(buf, alpha=-group["lr"])


def _toy(name: str, elementwise: bool = True) -> OptimizerSpec:
    return OptimizerSpec(
        name=name,
        states=(StateSpec("momentum_buffer"),),
        hyperparameters={"lr": 0.1, "momentum": 0.9},
        elementwise=elementwise,
        update=_sgd,
    )


@pytest.fixture
def toys():
    """'unit_sgd' (elementwise) and 'unit_whole' (whole matrices), registered for one test."""
    specs = [register_optimizer(_toy("unit_sgd")), register_optimizer(_toy("unit_whole", False))]
    yield specs
    for s in specs:
        unregister_optimizer(s.name)


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in ((6, 4), (4,), (3, 5), (5,))]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_adamw_spec_steps_as_torch_adamw_did():
    """The spec's groups rule (decay on matrices) and torch AdamW: 3 steps bitwise equal to
    torch.optim.AdamW built as the wrappers built it before the spec existed."""
    ours, ref = _params(), _params()
    hyper = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    opt = make_optimizer(ADAMW, [(p, p, "") for p in ours], hyper, fused=False)
    groups = [
        {"params": [p for p in ref if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in ref if p.dim() < 2], "weight_decay": 0.0},
    ]
    torch_opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, foreach=False)
    strip = [{k: v for k, v in g.items() if k != "params"} for g in torch_opt.param_groups]
    ours_only = {"params", "sources", "group", "tp_group"}  # make_optimizer's own keys
    assert [{k: v for k, v in g.items() if k not in ours_only} for g in opt.param_groups] == strip
    for step in range(3):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_update_spec_steps_as_torch_sgd():
    """A spec with a per-tensor update (SpecOptimizer): 3 steps bitwise equal to
    torch.optim.SGD(momentum=0.9); its state is the spec's, plus the step count."""
    ours, ref = _params(), _params()
    opt = make_optimizer(
        _toy("local"), [(p, p, "") for p in ours], {"lr": 0.1, "momentum": 0.9}, False
    )
    torch_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, foreach=False)
    for step in range(3):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    assert sorted(opt.state[ours[0]]) == ["momentum_buffer", "step"]
    assert opt.state[ours[0]]["step"].item() == 3


def test_registry(toys):
    assert optimizer_names()[0] == "adamw" and {"unit_sgd", "unit_whole"} <= set(optimizer_names())
    assert get_optimizer("adamw") is ADAMW and ADAMW.state_bytes == 8 and toys[0].state_bytes == 4
    with pytest.raises(ValueError, match="optimizer 'unit_sgd' is already registered"):
        register_optimizer(_toy("unit_sgd"))
    with pytest.raises(KeyError, match="optimizer 'nope' is not registered; registered: "):
        get_optimizer("nope")


BAD_SPECS = [
    (dict(update=None), "give exactly one of update= and make="),
    (dict(make=lambda g, h, f: None), "give exactly one of update= and make="),
    (dict(hyperparameters={"momentum": 0.9}), "hyperparameters need 'lr'"),
    (dict(states=(StateSpec("master"),)), "must be distinct, not step/master"),
    (dict(states=(StateSpec("a"), StateSpec("a"))), "must be distinct"),
    (dict(states=(StateSpec("row", shape="rows"),)), "state 'row' has shape='rows'; only"),
    (dict(groups=()), "groups must hold at least one ParamGroup"),
]


@pytest.mark.parametrize("change, needle", BAD_SPECS)
def test_bad_spec(change, needle):
    base = dict(name="bad", states=(StateSpec("m"),), hyperparameters={"lr": 1.0}, update=_sgd)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        OptimizerSpec(**{**base, **change})


ARGUMENT_CASES = [
    (dict(optimizer="nope"), "optimizer='nope': is not a registered optimizer. Fix: pass one of"),
    (dict(optimizer=3), "optimizer=3: is not a registered optimizer"),
    (dict(optimizer="unit_sgd", betas=(0.9, 0.95)), "optimizer 'unit_sgd' has no hyperparameter"),
    (dict(optimizer="unit_sgd", weight_decay=0.1), "weight_decay=0.1: optimizer 'unit_sgd' has"),
    (dict(optimizer="unit_sgd", optimizer_args={"nesterov": True}), "no hyperparameter 'nest"),
    (dict(optimizer="unit_sgd", optimizer_args={"lr": 1.0}), "holds 'lr'. Fix: pass lr= instead"),
    (dict(optimizer="unit_sgd", optimizer_args=[1]), "optimizer_args=[1]: must be a dict by name"),
    (
        dict(optimizer="unit_whole", zero_stage=1, offload=True),
        "offload=True: optimizer 'unit_whole' needs whole matrices",
    ),
    (
        dict(optimizer="muon", optimizer_args={"ns_steps": 0}),
        "optimizer_args={'ns_steps': 0}: muon hyperparameter ns_steps=0: must be a whole number",
    ),
    (
        dict(optimizer="muon", optimizer_args={"muon_params": ("attention", "norm")}),
        "muon_params=('attention', 'norm'): 'norm' parameters are not matrices (Muon's are)",
    ),
    (
        dict(optimizer="muon", optimizer_args={"muon_params": ()}),
        "muon hyperparameter muon_params=(): is empty: Muon would step nothing",
    ),
    (
        dict(optimizer="muon", optimizer_args={"muon_params": ("attn",)}),
        "'attn' is not a parameter kind",
    ),
    (dict(optimizer="muon", zero_stage=1, offload=True), "offload=True: optimizer 'muon' needs"),
]


@pytest.mark.parametrize("kwargs, needle", ARGUMENT_CASES, ids=[str(c[0]) for c in ARGUMENT_CASES])
def test_bad_optimizer_argument(toys, kwargs, needle):
    with pytest.raises(DataParallelArgumentError) as err:
        build_data_parallel([nn.Linear(2, 2)], None, **kwargs)  # refused before the mesh
    assert needle in str(err.value), str(err.value)
    assert "Fix: " in str(err.value)


def test_good_optimizer_arguments_reach_the_mesh_check(toys):
    """Valid spec arguments (by name or spec, with their own hyperparameters) pass every
    optimizer rule: the call ends on the mesh (None here)."""
    for kwargs in (
        dict(optimizer="unit_sgd", optimizer_args={"momentum": 0.5}),
        dict(optimizer=toys[0], lr=0.5),
        dict(optimizer=ADAMW, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1),
        dict(optimizer="unit_whole", zero_stage=2),
        dict(optimizer="unit_whole", zero_stage=3),
    ):
        with pytest.raises(DataParallelArgumentError, match="mesh=None"):
            build_data_parallel([nn.Linear(2, 2)], None, **kwargs)


CONFIG_CASES = [
    (["train.optimizer=nope"], "train.optimizer='nope': must be a registered optimizer: one of "),
    (
        ["train.optimizer=unit_sgd", "train.weight_decay=0.1"],
        "train.weight_decay=0.1: train.optimizer=unit_sgd has no weight decay",
    ),
    (
        [
            "train.optimizer=unit_whole",
            "train.weight_decay=0",
            "parallel.zero_stage=1",
            "train.optimizer_offload=cpu",
        ],
        "train.optimizer_offload='cpu': train.optimizer=unit_whole: its update needs whole",
    ),
    # the muon keys (the API side: ARGUMENT_CASES above), each named by its train.* key
    (
        ["train.optimizer=muon", "parallel.zero_stage=1", "train.optimizer_offload=cpu"],
        "train.optimizer_offload='cpu': train.optimizer=muon: its update needs whole matrices",
    ),
    (["train.optimizer=muon", "train.muon_ns_steps=0"], "train.muon_ns_steps=0: must be a whole"),
    (["train.optimizer=muon", "train.muon_ns_steps=100"], "train.muon_ns_steps=100: must be"),
    (
        ["train.optimizer=muon", "train.muon_params=[attention,norm]"],
        "train.muon_params=['attention', 'norm']: 'norm' parameters are not 2-D matrices",
    ),
    (
        ["train.optimizer=muon", "train.muon_params=[]"],
        "train.muon_params=[]: is empty: Muon would step no parameter",
    ),
    (
        ["train.optimizer=muon", "train.muon_params=[attn]"],
        "train.muon_params=['attn']: 'attn' is not a parameter group (groups: attention, mlp",
    ),
    (["train.optimizer=muon", "train.muon_ns_dtype=fp16"], "train.muon_ns_dtype='fp16': must be"),
    (["train.optimizer=muon", "train.muon_adjust_lr=rms"], "train.muon_adjust_lr='rms': must be"),
    (["train.optimizer=muon", "train.muon_momentum=1"], "train.muon_momentum=1.0: must be in [0"),
    (["train.optimizer=muon", "train.muon_lr=0"], "train.muon_lr=0.0: must be > 0"),
]


@pytest.mark.parametrize("overrides, needle", CONFIG_CASES, ids=[c[1][:40] for c in CONFIG_CASES])
def test_bad_config(toys, overrides, needle):
    with pytest.raises(ConfigError) as err:
        validate(load_config(SMOKE, overrides), 1)
    assert needle in str(err.value), str(err.value)


def test_config_accepts_a_registered_optimizer(toys):
    validate(load_config(SMOKE, ["train.optimizer=unit_sgd", "train.weight_decay=0"]), 1)
    whole = ["train.optimizer=unit_whole", "train.weight_decay=0", "parallel.zero_stage=3"]
    validate(load_config(SMOKE, whole), 1)


def test_param_group_rule_is_the_spec():
    """The groups rule reads the model parameter, not the tensor that steps (a flat piece)."""
    spec = OptimizerSpec(
        name="grouped",
        states=(),
        hyperparameters={"lr": 1.0, "momentum": 0.0},
        groups=(
            ParamGroup("matrices", lambda p, name: p.dim() >= 2),
            ParamGroup("rest", overrides={"lr": 0.0}),
        ),
        update=lambda p, g, s, group: p.add_(g, alpha=-group["lr"]),
    )
    matrix, vector = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))
    pieces = [matrix.detach().view(-1)[:3].clone(), vector.detach().clone()]
    named = list(zip(pieces, (matrix, vector), ("m", "v"), strict=True))
    opt = make_optimizer(spec, named, {"lr": 1.0}, False)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    assert [g["lr"] for g in opt.param_groups] == [1.0, 0.0]


def test_whole_matrix_formula_keeps_whole_gradients(toys):
    """A whole-matrix spec under ZeRO-2 holds every gradient whole (all-reduced, as ZeRO-1),
    its states over the N ranks; an elementwise one shards the gradients (4/N). Under ZeRO-3
    the owners' whole fp32 copies are its masters (4/N)."""
    from megatron_lite.parallel.data_parallel.memory import formula_bytes

    psi, n = 1_000_000, 4
    whole = formula_bytes(psi, "fp32", 2, n, optimizer=toys[1])
    sharded = formula_bytes(psi, "fp32", 2, n, optimizer=toys[0])
    assert whole["grads"] == 4 * psi and sharded["grads"] == 4 * psi / n
    assert whole["optimizer"] == sharded["optimizer"] == 4 * psi / n
    zero3 = formula_bytes(psi, "bf16", 3, n, optimizer=toys[1])
    assert zero3["master"] == 4 * psi / n and zero3["optimizer"] == 4 * psi / n
    assert formula_bytes(psi, "bf16", 3, n, optimizer=toys[0])["master"] == 0


def test_planner_counts_the_spec_states(toys):
    """The planner's model states (plan/memory.model_states, what --measure compares with the
    trainer's mem/*) and the peak walk's static states (plan/peak.static_states) hold the
    spec's state bytes: the toy's one fp32 momentum is 4 bytes per parameter on the rank's
    1/N share, half of AdamW's, every other term alike."""
    from megatron_lite.plan.activations import resolved
    from megatron_lite.plan.memory import model_states
    from megatron_lite.plan.params import rank_params
    from megatron_lite.plan.peak import static_states

    layout = ["train.weight_decay=0", "parallel.zero_stage=1", "parallel.dp=2"]
    adamw = resolved(load_config(SMOKE, layout), 2)
    toy = resolved(load_config(SMOKE, [*layout, "train.optimizer=unit_sgd"]), 2)
    dense, _ = rank_params(toy, 0)
    for states in (model_states, static_states):
        a, t = states(adamw, 0), states(toy, 0)
        assert t["optimizer"] == 4 * dense / 2 and a["optimizer"] == 2 * t["optimizer"], states
        assert {k: v for k, v in a.items() if k != "optimizer"} == {
            k: v for k, v in t.items() if k != "optimizer"
        }, states


def test_adam_keys_warn_without_adam(toys):
    """adam_* keys changed for an optimizer without betas / eps: a warning each, naming the
    key and the optimizer; none for AdamW or at their defaults."""
    from megatron_lite.validation import config_warnings

    changed = ["train.adam_beta1=0.8", "train.adam_eps=1e-6", "train.weight_decay=0"]
    toy = config_warnings(load_config(SMOKE, [*changed, "train.optimizer=unit_sgd"]))
    adam = [w for w in toy if "adam_" in w]
    assert adam == [
        "train.adam_beta1=0.8 has no effect: train.optimizer=unit_sgd has no hyperparameter "
        "betas. Fix: remove the key (or use an optimizer that has it).",
        "train.adam_eps=1e-06 has no effect: train.optimizer=unit_sgd has no hyperparameter "
        "eps. Fix: remove the key (or use an optimizer that has it).",
    ], toy
    assert not [w for w in config_warnings(load_config(SMOKE, changed)) if "adam_" in w]
    plain = config_warnings(load_config(SMOKE, ["train.optimizer=unit_sgd"]))
    assert not [w for w in plain if "adam_" in w]


def test_optimizer_args_reach_the_spec(toys):
    """train.optimizer_args: the spec's own hyperparameters, passed to build_data_parallel
    (training/optimizer.optimizer_arguments); adam_* reach only an optimizer with betas/eps;
    a name the spec lacks, or one with its own key, is refused naming the key."""
    from megatron_lite.training.optimizer import optimizer_arguments

    cfg = load_config(
        SMOKE,
        [
            "train.optimizer=unit_sgd",
            "train.weight_decay=0",
            "train.optimizer_args={momentum: 0.5}",
        ],
    )
    validate(cfg, 1)
    got = optimizer_arguments(cfg.train)
    assert got["optimizer_args"] == {"momentum": 0.5} and got["betas"] is got["eps"] is None, got
    adam = optimizer_arguments(load_config(SMOKE, ["train.adam_beta1=0.8"]).train)
    assert adam["betas"] == (0.8, 0.95) and adam["eps"] == 1e-8 and adam["optimizer_args"] is None
    for args, needle in (
        ("{nesterov: true}", "'nesterov' is not one of train.optimizer=unit_sgd's own"),
        (
            "{lr: 0.1}",
            "'lr' is not one of train.optimizer=unit_sgd's own hyperparameters (momentum)",
        ),
    ):
        over = ["train.optimizer=unit_sgd", "train.weight_decay=0", f"train.optimizer_args={args}"]
        with pytest.raises(ConfigError) as err:
            validate(load_config(SMOKE, over), 1)
        assert "train.optimizer_args=" in str(err.value) and needle in str(err.value), err.value
