"""The Muon optimizer's record (`train.optimizer=muon`): its parameter groups, hyperparameters,
their checks and config keys, and its cost, registered under "muon" (optimizer_spec.py loads
this module on the first lookup). The update itself (Newton–Schulz on whole matrices, the TP
gathers) is muon.py, loaded when an optimizer is built: config validation and the planner read
this record without loading DTensor or the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from megatron_lite.parallel.data_parallel.optimizer_spec import (
    OptimizerSpec,
    ParamGroup,
    StateSpec,
    register_optimizer,
)

MATRIX_KINDS = ("attention", "mlp", "experts", "hidden", "embedding", "output", "router")
VECTOR_KINDS = ("norm", "bias", "expert_bias")
KINDS = MATRIX_KINDS + VECTOR_KINDS
DEFAULT_MUON_PARAMS = ("attention", "mlp", "experts", "hidden")
ADJUST_LR = ("original", "match_rms_adamw")
NS_DTYPE_NAMES = ("bf16", "fp32")


def param_kind(param: torch.nn.Parameter, name: str) -> str:
    """The kind of a model parameter (one of KINDS) from its name in its chunk and its rank:
    embedding (word or position tables), output (the output layer), router (MoE router and
    shared-expert gate), experts (an expert stack), attention, mlp, hidden (any other
    matrix); norm, bias and expert_bias for vectors."""
    dotted = f".{name}."
    if "expert_bias" in name:
        return "expert_bias"
    if param.dim() < 2:
        return "norm" if "norm" in name else "bias"
    if "embedding" in name:
        return "embedding"
    if "output_layer" in name:
        return "output"
    if ".router." in dotted or "shared_expert_gate" in name:
        return "router"
    if ".experts." in dotted or getattr(getattr(param, "meta", None), "is_expert", False):
        return "experts"
    if "attention" in name:
        return "attention"
    if ".mlp." in dotted:
        return "mlp"
    return "hidden"


def _make(groups: list[dict], hyper: dict, fused: bool):
    """muon.make: torch AdamW over the adamw groups, Muon over the muon group."""
    from megatron_lite.parallel.data_parallel.muon import make

    return make(groups, hyper, fused)


def _cost(param: torch.nn.Parameter, hyper: Mapping[str, Any]) -> int:
    """muon.param_ns_flops: one step's Newton–Schulz FLOPs of `param` (its owner's cost)."""
    from megatron_lite.parallel.data_parallel.muon import param_ns_flops

    return param_ns_flops(param, hyper)


def _groups(hyper: Mapping[str, Any]) -> tuple[ParamGroup, ...]:
    """Muon's group (the kinds of muon_params), then AdamW's two (decay on matrices only)."""
    kinds = set(hyper["muon_params"])
    muon_lr = hyper["muon_lr"]
    lr = {"lr": muon_lr, "lr_scale": muon_lr / hyper["lr"]} if muon_lr is not None else {}
    adam = (StateSpec("exp_avg"), StateSpec("exp_avg_sq"))
    return (
        ParamGroup(
            "muon",
            lambda p, name: param_kind(p, name) in kinds,
            {"algorithm": "muon", **lr},
            states=(StateSpec("momentum_buffer"),),
            elementwise=False,
        ),
        ParamGroup("adamw_decay", lambda p, name: p.dim() >= 2, {"algorithm": "adamw"}, adam,
                   elementwise=True),
        ParamGroup("adamw_no_decay", overrides={"algorithm": "adamw", "weight_decay": 0.0},
                   states=adam, elementwise=True),
    )  # fmt: skip


class HyperparameterError(ValueError):
    """A hyperparameter out of its range; `name` is the hyperparameter (CONFIG_KEYS maps it
    to its train.* key)."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


def check_hyperparameters(hyper: Mapping[str, Any]) -> None:
    """Each Muon hyperparameter in its range; the ValueError names it, the rule and a fix."""

    def bad(name: str, rule: str, fix: str) -> HyperparameterError:
        text = f"muon hyperparameter {name}={hyper[name]!r}: {rule}. Fix: {fix}"
        return HyperparameterError(text, name)

    steps = hyper["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 99:
        raise bad("ns_steps", "must be a whole number from 1 to 99", "use 5 (the default)")
    if not (isinstance(hyper["momentum"], int | float) and 0 <= hyper["momentum"] < 1):
        raise bad("momentum", "must be in [0, 1)", "use 0.95 (the default)")
    if hyper["ns_dtype"] not in NS_DTYPE_NAMES:
        raise bad("ns_dtype", f"must be one of {list(NS_DTYPE_NAMES)}", "use bf16 (the default)")
    if hyper["adjust_lr"] not in ADJUST_LR:
        raise bad("adjust_lr", f"must be one of {list(ADJUST_LR)}", "use match_rms_adamw")
    if not isinstance(hyper["nesterov"], bool) or not isinstance(hyper["split_fused"], bool):
        which = "nesterov" if not isinstance(hyper["nesterov"], bool) else "split_fused"
        raise bad(which, "must be true or false", f"set {which} to a bool")
    lr = hyper["muon_lr"]
    if lr is not None and not (isinstance(lr, int | float) and lr > 0 and math.isfinite(lr)):
        raise bad("muon_lr", "must be a positive number or None (train.lr)", "use e.g. 0.02")
    kinds = hyper["muon_params"]
    if isinstance(kinds, str) or not all(isinstance(k, str) for k in kinds):
        raise bad(
            "muon_params", "must be a list of parameter kinds", f"use e.g. {DEFAULT_MUON_PARAMS}"
        )
    if not kinds:
        raise bad("muon_params", "is empty: Muon would step nothing (an AdamW run)",
                  "list kinds, e.g. the default; or use the adamw optimizer")  # fmt: skip
    for k in kinds:
        if k in VECTOR_KINDS:
            fix = f"leave {k!r} to AdamW; matrix kinds: {', '.join(MATRIX_KINDS)}"
            raise bad("muon_params", f"{k!r} parameters are not matrices (Muon's are)", fix)
        if k not in MATRIX_KINDS:
            raise bad("muon_params", f"{k!r} is not a parameter kind (kinds: "
                      f"{', '.join(MATRIX_KINDS)})", "use kinds from that list")  # fmt: skip


CONFIG_KEYS = {  # train.<key> -> the muon spec's hyperparameter (the config's names)
    "muon_params": "muon_params", "muon_momentum": "momentum", "muon_nesterov": "nesterov",
    "muon_ns_steps": "ns_steps", "muon_ns_dtype": "ns_dtype", "muon_adjust_lr": "adjust_lr",
    "muon_split_fused": "split_fused", "muon_lr": "muon_lr",
}  # fmt: skip


def config_arguments(train) -> dict[str, Any]:
    """The spec's own hyperparameters from a run config's train section (train.muon_*)."""
    out = {name: getattr(train, key) for key, name in CONFIG_KEYS.items()}
    out["muon_params"] = tuple(out["muon_params"])
    return out


MUON = register_optimizer(
    OptimizerSpec(
        name="muon",
        states=(StateSpec("momentum_buffer"), StateSpec("exp_avg"), StateSpec("exp_avg_sq")),
        hyperparameters={
            "lr": 1e-3,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "momentum": 0.95,
            "nesterov": True,
            "ns_steps": 5,
            "ns_dtype": "bf16",
            "adjust_lr": "match_rms_adamw",
            "split_fused": True,
            "muon_lr": None,
            "muon_params": DEFAULT_MUON_PARAMS,
        },  # fmt: skip
        elementwise=False,
        groups=_groups,
        make=_make,
        check=check_hyperparameters,
        cost=_cost,
    )
)
