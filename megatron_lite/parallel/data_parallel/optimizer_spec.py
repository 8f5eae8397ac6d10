"""Optimizers as records: one `OptimizerSpec` per optimizer holds everything the data-parallel
wrappers, the checkpoints, the memory report and the planner know of it: its per-parameter
state tensors (names, dtypes, shaped like the parameter), whether its update is elementwise
(any shard of a parameter will do) or needs the whole matrix, its parameter groups rule, its
hyperparameters with their defaults, and the update. `register_optimizer` adds one; a spec or
its registered name is what `build_data_parallel(optimizer=...)` and `train.optimizer` take.

The registry (`_SPECS`, filled by `register_optimizer` calls) is the one module-level mutable
state allowed here, as in pipeline/registry.py. AdamW is registered below.

The update is either
- `update(param, grad, state, group)`: one tensor in place (the fp32 master, its gradient, its
  states by name plus "step", a 0-d fp32 count already incremented, and its group's
  hyperparameters); elementwise specs get flat pieces of a parameter, whole-matrix specs the
  parameter's shape. `SpecOptimizer` runs it as a torch optimizer; or
- `make(groups, hyperparameters, fused)`: a torch optimizer over `groups` (torch param-group
  dicts), for a spec whose arithmetic is torch's own (AdamW: per tensor on CPU, fused on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lite.registry import Registry

__all__ = [
    "ADAMW", "NAMED_HYPERPARAMETERS", "OptimizerSpec", "ParamGroup", "SpecOptimizer",
    "StateSpec", "get_optimizer", "hyperparameters", "init_states", "make_optimizer",
    "optimizer_names", "register_optimizer", "resolve_optimizer", "unregister_optimizer",
]  # fmt: skip

SHAPES = ("param",)  # what a state's shape may be relative to its parameter (see StateSpec)
# the hyperparameters build_data_parallel (and the config: train.lr, adam_*, weight_decay) takes
# as arguments of their own; a spec's others go through optimizer_args
NAMED_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class StateSpec:
    """One per-parameter state tensor: its name (the checkpoint's `optim/<name>/...`) and
    dtype. shape "param": the parameter's own shape, so ZeRO-1/2 and FSDP2 shard it exactly
    like the parameter and checkpoints cut it like the parameter (the only shape supported)."""

    name: str
    dtype: torch.dtype = torch.float32
    shape: str = "param"

    @property
    def bytes_per_element(self) -> int:
        """Bytes of this state per parameter element."""
        return torch.empty((), dtype=self.dtype).element_size()


def _everything(param: torch.nn.Parameter) -> bool:
    return True


@dataclass(frozen=True)
class ParamGroup:
    """A parameter group: the parameters `applies(param)` picks (the model's parameter, with
    its TP-local shape, never a shard of it) step with the spec's hyperparameters updated by
    `overrides`. A spec's groups are tried in order, the first that applies wins."""

    name: str
    applies: Callable[[torch.nn.Parameter], bool] = _everything
    overrides: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer (the value of `train.optimizer`, or `build_data_parallel(optimizer=)`).

    states: its per-parameter state tensors (a "step" count is kept beside them, always).
    elementwise: True when the update of an element reads only that element's parameter,
        gradient and states (any shard will do: ZeRO-1/2 flat ranges, FSDP2 rows); False when
        it needs each parameter whole (ZeRO-1/2 then assign whole parameters to ranks, see
        optimizer.py; ZeRO-3 is refused).
    hyperparameters: names and defaults; "lr" is required (the trainer's schedule sets it).
    groups: the parameter groups rule (`ParamGroup`s, the last should apply to every
        parameter). update / make: the module docstring (exactly one of them).
    """

    name: str
    states: tuple[StateSpec, ...]
    hyperparameters: Mapping[str, Any]
    elementwise: bool = True
    groups: tuple[ParamGroup, ...] = (ParamGroup("all"),)
    update: Callable[[torch.Tensor, torch.Tensor, dict, dict], None] | None = None
    make: Callable[[list[dict], dict, bool], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        where = f"optimizer {self.name!r}"
        if (self.update is None) == (self.make is None):
            raise ValueError(f"{where}: give exactly one of update= and make=")
        if "lr" not in self.hyperparameters:
            raise ValueError(f"{where}: hyperparameters need 'lr' (the LR schedule sets it)")
        names = [s.name for s in self.states]
        if len(set(names)) != len(names) or {"step", "master"} & set(names):
            raise ValueError(f"{where}: state names {names} must be distinct, not step/master")
        for s in self.states:
            if s.shape not in SHAPES:
                raise ValueError(
                    f"{where}: state {s.name!r} has shape={s.shape!r}; only {SHAPES} is "
                    "supported (checkpoints and ZeRO shards cut states like the parameter)"
                )
        if not self.groups:
            raise ValueError(f"{where}: groups must hold at least one ParamGroup")

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def state_bytes(self) -> int:
        """Optimizer-state bytes per parameter element (the memory report's "optimizer")."""
        return sum(s.bytes_per_element for s in self.states)


_SPECS: Registry[OptimizerSpec] = Registry("optimizer")


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Add an optimizer under `spec.name` (a name taken is an error); returns the spec."""
    return _SPECS.add(spec)


def unregister_optimizer(name: str) -> None:
    """Remove a registered optimizer (tests that register a toy one)."""
    _SPECS.remove(name)


def optimizer_names() -> tuple[str, ...]:
    return _SPECS.names()


def get_optimizer(name: str) -> OptimizerSpec:
    """The registered spec `name`; a KeyError names the registered ones."""
    if name not in _SPECS:
        raise KeyError(f"optimizer {name!r} is not registered; registered: {optimizer_names()}")
    return _SPECS.get(name)


def resolve_optimizer(optimizer: str | OptimizerSpec) -> OptimizerSpec:
    """A spec, or the registered spec of a name."""
    return optimizer if isinstance(optimizer, OptimizerSpec) else get_optimizer(optimizer)


def hyperparameters(spec: OptimizerSpec, given: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's defaults updated by `given` (names the spec lacks: a ValueError)."""
    unknown = sorted(set(given) - set(spec.hyperparameters))
    if unknown:
        raise ValueError(
            f"optimizer {spec.name!r} has no hyperparameter(s) {unknown}; "
            f"its hyperparameters: {sorted(spec.hyperparameters)}"
        )
    return {**spec.hyperparameters, **given}


def init_states(spec: OptimizerSpec, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zeroed states of one tensor (a parameter, a piece of one), as its first step sees them."""
    return {s.name: torch.zeros_like(like, dtype=s.dtype) for s in spec.states}


def make_optimizer(
    spec: OptimizerSpec,
    tensors: list[tuple[torch.Tensor, torch.nn.Parameter]],
    hyper: dict[str, Any],
    fused: bool,
) -> torch.optim.Optimizer:
    """The torch optimizer stepping `tensors` ((what steps: a master or a sharded parameter,
    the model parameter it stands for)), grouped by `spec.groups` in their order (empty groups
    kept, so every layout has the same groups). `fused`: the GPU's kernels (CUDA, a dry run)."""
    members: list[list[torch.Tensor]] = [[] for _ in spec.groups]
    for t, param in tensors:
        i = next((i for i, g in enumerate(spec.groups) if g.applies(param)), None)
        if i is None:
            raise ValueError(f"optimizer {spec.name!r}: no group applies to a parameter")
        members[i].append(t)
    groups = [{"params": m, **g.overrides} for g, m in zip(spec.groups, members, strict=True)]
    if spec.make is not None:
        return spec.make(groups, hyper, fused)
    return SpecOptimizer(groups, spec, hyper)


class SpecOptimizer(torch.optim.Optimizer):
    """A torch optimizer running `spec.update` per tensor (states made at the first step, or
    before by the wrappers, see `init_states`; "step" a 0-d fp32 count on the host)."""

    def __init__(self, groups: list[dict], spec: OptimizerSpec, hyper: dict[str, Any]):
        super().__init__(groups, dict(hyper))
        self.spec = spec

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros(()), **init_states(self.spec, p))
                state["step"] += 1
                self.spec.update(p, p.grad, state, group)


def _torch_adamw(groups: list[dict], hyper: dict[str, Any], fused: bool) -> torch.optim.Optimizer:
    """torch AdamW: per tensor on CPU (every layout does the same arithmetic per element),
    fused on CUDA and in a dry run (the GPU's kernel; the per-tensor path reads its step count
    on the host)."""
    return torch.optim.AdamW(
        groups,
        lr=hyper["lr"],
        betas=hyper["betas"],
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        foreach=False,
        fused=fused or None,
    )


def _is_matrix(param: torch.nn.Parameter) -> bool:
    return param.dim() >= 2


ADAMW = register_optimizer(
    OptimizerSpec(
        name="adamw",
        states=(StateSpec("exp_avg"), StateSpec("exp_avg_sq")),
        hyperparameters={"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
        # weight decay on matrices only, not on norms, biases or other 1-D parameters
        groups=(
            ParamGroup("decay", _is_matrix),
            ParamGroup("no_decay", overrides={"weight_decay": 0.0}),
        ),
        make=_torch_adamw,
    )
)
