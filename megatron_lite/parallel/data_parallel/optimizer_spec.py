"""Optimizers as records: one `OptimizerSpec` per optimizer holds everything the data-parallel
wrappers, the checkpoints, the memory report and the planner know of it: its per-parameter
state tensors (names, dtypes, shaped like the parameter), whether its update is elementwise
(any shard of a parameter will do) or needs the whole matrix, its parameter groups rule, its
hyperparameters with their defaults, and the update. `register_optimizer` adds one; a spec or
its registered name is what `build_data_parallel(optimizer=...)` and `train.optimizer` take.

The registry (`_SPECS`, filled by `register_optimizer` calls) is the one module-level mutable
state allowed here, as in pipeline/registry.py. AdamW is registered below, Muon (with AdamW for
the parameters that are not hidden matrices: a spec whose groups differ in states and update)
in muon.py.

The update is either
- `update(param, grad, state, group)`: one tensor in place (the fp32 master, its gradient, its
  states by name plus "step", a 0-d fp32 count already incremented, and its group's
  hyperparameters); elementwise specs get flat pieces of a parameter, whole-matrix specs the
  parameter's shape. `SpecOptimizer` runs it as a torch optimizer; or
- `make(groups, hyperparameters, fused)`: a torch optimizer over `groups` (torch param-group
  dicts, see `make_optimizer`), for a spec whose arithmetic is torch's own (AdamW: per tensor
  on CPU, fused on CUDA), or several (muon.py's `Chained`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lite.registry import Registry

__all__ = [
    "ADAMW", "NAMED_HYPERPARAMETERS", "OptimizerSpec", "ParamGroup", "SpecOptimizer",
    "StateSpec", "get_optimizer", "group_index", "hyperparameters", "init_states",
    "make_optimizer", "needs_whole", "optimizer_names", "register_optimizer",
    "resolve_optimizer", "tensor_groups", "unregister_optimizer",
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


def _everything(param: torch.nn.Parameter, name: str) -> bool:
    return True


@dataclass(frozen=True)
class ParamGroup:
    """A parameter group: the parameters `applies(param, name)` picks (the model's parameter,
    with its TP-local shape, never a shard of it, and its name in its model chunk, "" where
    unknown) step with the spec's hyperparameters updated by `overrides`. A spec's groups are
    tried in order, the first that applies wins. `states` / `elementwise`: this group's own
    (None: the spec's), for a spec that steps groups with different rules (Muon's matrices
    whole, AdamW's others elementwise): its states must be among the spec's."""

    name: str
    applies: Callable[[torch.nn.Parameter, str], bool] = _everything
    overrides: Mapping[str, Any] = field(default_factory=dict)
    states: tuple[StateSpec, ...] | None = None
    elementwise: bool | None = None


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer (the value of `train.optimizer`, or `build_data_parallel(optimizer=)`).

    states: its per-parameter state tensors (a "step" count is kept beside them, always);
        every state any group holds (a group may hold some of them, `ParamGroup.states`).
    elementwise: True when the update of an element reads only that element's parameter,
        gradient and states (any shard will do: ZeRO-1/2 flat ranges, FSDP2 rows); False when
        it needs each parameter whole, or some group does (`ParamGroup.elementwise`): those
        parameters get whole-parameter owner ranks (whole_matrix.py; ZeRO-3:
        fsdp_whole_matrix.py).
    hyperparameters: names and defaults; "lr" is required (the trainer's schedule sets it).
    groups: the parameter groups rule (`ParamGroup`s, the last should apply to every
        parameter), or a function of the hyperparameters returning them (groups the user
        configures, e.g. which parameters Muon steps). update / make: the module docstring
        (exactly one of them).
    check: raises ValueError naming a hyperparameter that is out of its range (None: none).
    cost: one step's cost of a parameter's whole-matrix update (ownership is balanced by it,
        whole_matrix.py; None: its elements).
    """

    name: str
    states: tuple[StateSpec, ...]
    hyperparameters: Mapping[str, Any]
    elementwise: bool = True
    groups: tuple[ParamGroup, ...] | Callable[[Mapping[str, Any]], tuple[ParamGroup, ...]] = (
        ParamGroup("all"),
    )
    update: Callable[[torch.Tensor, torch.Tensor, dict, dict], None] | None = None
    make: Callable[[list[dict], dict, bool], torch.optim.Optimizer] | None = None
    check: Callable[[Mapping[str, Any]], None] | None = None
    cost: Callable[[torch.nn.Parameter, Mapping[str, Any]], float] | None = None

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
        if not callable(self.groups):
            check_groups(self, self.groups)

    def param_groups(self, hyper: Mapping[str, Any]) -> tuple[ParamGroup, ...]:
        """The groups rule for these hyperparameters."""
        if not callable(self.groups):
            return self.groups
        groups = tuple(self.groups(hyper))
        check_groups(self, groups)
        return groups

    def group_states(self, group: ParamGroup) -> tuple[StateSpec, ...]:
        """The states a parameter of `group` holds."""
        return self.states if group.states is None else group.states

    def group_elementwise(self, group: ParamGroup) -> bool:
        """Whether `group`'s update is elementwise (any shard of a parameter will do)."""
        return self.elementwise if group.elementwise is None else group.elementwise

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def state_bytes(self) -> int:
        """Optimizer-state bytes per parameter element of a group holding every state (the
        memory report's "optimizer"; a group's own: `group_state_bytes`)."""
        return sum(s.bytes_per_element for s in self.states)

    def group_state_bytes(self, group: ParamGroup) -> int:
        """Optimizer-state bytes per element of a parameter of `group`."""
        return sum(s.bytes_per_element for s in self.group_states(group))


def check_groups(spec: OptimizerSpec, groups: tuple[ParamGroup, ...]) -> None:
    """At least one group; each group's states among the spec's; a whole-matrix group only in
    a spec that says it is not elementwise."""
    where = f"optimizer {spec.name!r}"
    if not groups:
        raise ValueError(f"{where}: groups must hold at least one ParamGroup")
    for g in groups:
        extra = set(s.name for s in spec.group_states(g)) - set(spec.state_names)
        if extra:
            raise ValueError(f"{where}: group {g.name!r} has states {sorted(extra)} the spec lacks")
        if not spec.group_elementwise(g) and spec.elementwise:
            raise ValueError(
                f"{where}: group {g.name!r} needs whole matrices; say elementwise=False on the spec"
            )


def group_index(
    spec: OptimizerSpec, groups: tuple[ParamGroup, ...], param: torch.nn.Parameter, name: str
) -> int:
    """The index of the first of `groups` that applies to `param` (named `name`)."""
    i = next((i for i, g in enumerate(groups) if g.applies(param, name)), None)
    if i is None:
        raise ValueError(f"optimizer {spec.name!r}: no group applies to parameter {name!r}")
    return i


def needs_whole(spec: OptimizerSpec, hyper: Mapping[str, Any], named_params) -> dict[int, bool]:
    """{id(param): whether its group needs it whole} over (name, param) pairs."""
    groups = spec.param_groups(hyper)
    return {
        id(p): not spec.group_elementwise(groups[group_index(spec, groups, p, n)])
        for n, p in named_params
    }


_SPECS: Registry[OptimizerSpec] = Registry("optimizer")
# modules registering the other shipped specs, loaded on the first lookup (they import this one)
BUILTIN_SPECS = ("megatron_lite.parallel.data_parallel.muon_spec",)


def _specs() -> Registry[OptimizerSpec]:
    """The registry, with the shipped specs of BUILTIN_SPECS registered."""
    for module in BUILTIN_SPECS:
        importlib.import_module(module)
    return _SPECS


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Add an optimizer under `spec.name` (a name taken is an error); returns the spec."""
    return _SPECS.add(spec)


def unregister_optimizer(name: str) -> None:
    """Remove a registered optimizer (tests that register a toy one)."""
    _SPECS.remove(name)


def optimizer_names() -> tuple[str, ...]:
    return _specs().names()


def get_optimizer(name: str) -> OptimizerSpec:
    """The registered spec `name`; a KeyError names the registered ones."""
    if name not in _specs():
        raise KeyError(f"optimizer {name!r} is not registered; registered: {optimizer_names()}")
    return _SPECS.get(name)


def resolve_optimizer(optimizer: str | OptimizerSpec) -> OptimizerSpec:
    """A spec, or the registered spec of a name."""
    return optimizer if isinstance(optimizer, OptimizerSpec) else get_optimizer(optimizer)


def hyperparameters(spec: OptimizerSpec, given: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's defaults updated by `given` (names the spec lacks, or values its `check`
    refuses: a ValueError)."""
    unknown = sorted(set(given) - set(spec.hyperparameters))
    if unknown:
        raise ValueError(
            f"optimizer {spec.name!r} has no hyperparameter(s) {unknown}; "
            f"its hyperparameters: {sorted(spec.hyperparameters)}"
        )
    hyper = {**spec.hyperparameters, **given}
    if spec.check is not None:
        spec.check(hyper)
    return hyper


def init_states(
    spec: OptimizerSpec, like: torch.Tensor, group: ParamGroup | None = None
) -> dict[str, torch.Tensor]:
    """Zeroed states of one tensor (a parameter, a piece of one) of `group` (None: every
    state of the spec), as its first step sees them."""
    states = spec.states if group is None else spec.group_states(group)
    return {s.name: torch.zeros_like(like, dtype=s.dtype) for s in states}


def make_optimizer(
    spec: OptimizerSpec,
    tensors: list[tuple[torch.Tensor, torch.nn.Parameter, str]],
    hyper: dict[str, Any],
    fused: bool,
    tp_group=None,
) -> torch.optim.Optimizer:
    """The torch optimizer stepping `tensors` ((what steps: a master or a sharded parameter,
    the model parameter it stands for, that parameter's name)), grouped by the spec's groups
    in their order (empty groups kept, so every layout has the same groups). Each torch group
    dict also holds "sources" (the model parameters, for a whole-matrix update that reads
    their TP layout, params.ParamMeta), "group" (its ParamGroup) and "tp_group" (the TP
    process group, None: one rank). `fused`: the GPU's kernels (CUDA, a dry run)."""
    rule = spec.param_groups(hyper)
    members: list[list[torch.Tensor]] = [[] for _ in rule]
    sources: list[list[torch.nn.Parameter]] = [[] for _ in rule]
    for t, param, name in tensors:
        i = group_index(spec, rule, param, name)
        members[i].append(t)
        sources[i].append(param)
    groups = [
        {"params": m, "sources": s, "group": g, "tp_group": tp_group, **g.overrides}
        for g, m, s in zip(rule, members, sources, strict=True)
    ]
    if spec.make is not None:
        return spec.make(groups, hyper, fused)
    return SpecOptimizer(groups, spec, hyper)


def tensor_groups(optimizer: torch.optim.Optimizer) -> dict[int, ParamGroup]:
    """{id(tensor it steps): its ParamGroup} of an optimizer `make_optimizer` built."""
    return {id(t): g["group"] for g in optimizer.param_groups for t in g["params"]}


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
                    state.update(step=torch.zeros(()), **init_states(self.spec, p, group["group"]))
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


def _is_matrix(param: torch.nn.Parameter, name: str) -> bool:
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
