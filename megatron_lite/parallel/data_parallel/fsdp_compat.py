"""What ZeRO-3 uses of torch's FSDP2, checked before it is used: `check_fsdp2()` runs in config
validation (before any process group exists) and again when `FullyShardedDataParallel` is built
(before any DeviceMesh), and fails naming what changed, who relies on it and the torch versions
supported. Without it, a changed private signature shows only in step 1, and for the collective
overrides (which FSDP2 calls, by keyword) possibly on some ranks only: a hang.

Public FSDP2 (torch.distributed.fsdp, torch >= 2.6): `fully_shard`, `MixedPrecisionPolicy`,
`FSDPModule`'s setters, `DeviceMesh.from_group`: the arguments we pass must still bind.
Private: the default collective classes `fsdp_comm.py` subclasses, whose `__call__` FSDP2 calls
with these exact parameters (our overrides take exactly those), and the param-group methods the
dry run's memory tracker wraps. The custom-collective API (`set_custom_all_gather`, the
`Default*` classes) came with pytorch#155189 (merged mid 2025, so torch 2.9 by its date; not
checked on an install here): on a torch without it, FSDP2's collectives are simply not counted
in comm_stats (`fsdp_comm.count_collectives` returns False); anything else missing is an error.

Verified against torch 2.13.0 (the only install here) and, by reading, pytorch main's
_fsdp_collectives.py, whose collective signatures are the same.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch

MIN_TORCH = (2, 6)  # FSDP2 exported from torch.distributed.fsdp
VERIFIED = "2.13.0"
SUPPORTED = f"torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (verified on {VERIFIED})"
FSDP = "torch.distributed.fsdp"
PRIVATE = "torch.distributed.fsdp._fully_shard"


class FSDP2APIError(RuntimeError):
    """torch's FSDP2 no longer has the shape megatron_lite's ZeRO-3 uses."""


@dataclass(frozen=True)
class Use:
    """One thing of torch's that ZeRO-3 uses. `names`: attribute paths in `module`, any one
    will do (older torch names some differently). `call`: how we call it, (positional
    arguments, self included, and keyword names), which must bind; `override`: the exact
    parameters (name, default) torch calls our override with. `optional`: may be absent (the
    feature it serves is then off), but when present must have this shape."""

    module: str
    names: tuple[str, ...]
    user: str
    call: tuple[int, tuple[str, ...]] | None = None
    override: tuple[tuple[str, object], ...] | None = None
    optional: bool = False


_NONE = inspect.Parameter.empty
_SETTER = (2, ())  # module.set_...(value)
USES = (
    Use(FSDP, ("fully_shard",), "fsdp.py (sharding each unit)",
        call=(1, ("mesh", "reshard_after_forward", "mp_policy"))),
    Use(FSDP, ("MixedPrecisionPolicy",), "fsdp.py (param and reduce dtypes)",
        call=(0, ("param_dtype", "reduce_dtype", "cast_forward_inputs"))),
    Use(FSDP, ("FSDPModule.set_requires_gradient_sync",), "fsdp.py (gradient accumulation)",
        call=_SETTER),
    Use(FSDP, ("FSDPModule.set_is_last_backward",), "fsdp.py (gradient accumulation)",
        call=_SETTER),
    Use(FSDP, ("FSDPModule.set_modules_to_forward_prefetch",), "fsdp.py (prefetching)",
        call=_SETTER),
    Use(FSDP, ("FSDPModule.set_modules_to_backward_prefetch",), "fsdp.py (prefetching)",
        call=_SETTER),
    Use(FSDP, ("FSDPModule.set_gradient_divide_factor",
               "FSDPModule.set_reduce_scatter_divide_factor"), "fsdp.py (summed gradients)",
        call=_SETTER),
    Use(FSDP, ("FSDPModule.set_force_sum_reduction_for_comms",), "fsdp.py (summed gradients)",
        call=_SETTER, optional=True),
    Use(FSDP, ("FSDPModule.set_custom_all_gather",), "fsdp_comm.py (counting collectives)",
        call=_SETTER, optional=True),
    Use(FSDP, ("FSDPModule.set_custom_reduce_scatter",), "fsdp_comm.py (counting collectives)",
        call=_SETTER, optional=True),
    Use("torch.distributed.device_mesh", ("DeviceMesh.from_group",),
        "fsdp.py and mesh.py (1-D and HSDP meshes from our groups)",
        call=(2, ("mesh", "mesh_dim_names"))),
    Use(f"{PRIVATE}._fsdp_collectives", ("DefaultAllGather.__init__",),
        "fsdp_comm.py (CountingAllGather())", call=(1, ()), optional=True),
    Use(f"{PRIVATE}._fsdp_collectives", ("DefaultAllGather.__call__",),
        "fsdp_comm.py (CountingAllGather overrides it)", optional=True,
        override=(("self", _NONE), ("output_tensor", _NONE), ("input_tensor", _NONE),
                  ("group", _NONE), ("async_op", False))),
    Use(f"{PRIVATE}._fsdp_collectives", ("DefaultReduceScatter.__init__",),
        "fsdp_comm.py (CountingReduceScatter())", call=(1, ()), optional=True),
    Use(f"{PRIVATE}._fsdp_collectives", ("DefaultReduceScatter.__call__",),
        "fsdp_comm.py (CountingReduceScatter overrides it)", optional=True,
        override=(("self", _NONE), ("output_tensor", _NONE), ("input_tensor", _NONE),
                  ("group", _NONE), ("op", _NONE), ("async_op", False))),
    Use(FSDP, ("FSDPModule._get_fsdp_state",), "training/memory_tracker.py (dry run)",
        call=(1, ())),
    Use(f"{PRIVATE}._fsdp_param_group", ("FSDPParamGroup.unshard",),
        "training/memory_tracker.py (dry run: labels the all-gathers)"),
    Use(f"{PRIVATE}._fsdp_param_group", ("FSDPParamGroup.post_backward",),
        "training/memory_tracker.py (dry run: labels the reduce-scatters) and "
        "post_backward_now (zero-bubble schedules)", call=(1, ())),
    Use(f"{PRIVATE}._fsdp_state", ("FSDPState._root_post_backward_final_callback",),
        "post_backward_now (zero-bubble schedules)", call=(1, ())),
)  # fmt: skip


def _param_groups(state) -> list:
    """An FSDP state's parameter groups: a list in torch 2.13, one optional group before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def post_backward_now(root, reduce: bool) -> None:
    """Run FSDP2's post-backward for every unit under `root` (a root `FSDPModule`) outside
    autograd, then the end of a backward, for gradients written after FSDP2's own hook ran (a
    zero-bubble schedule's W). `reduce`: reduce-scatter what the units accumulated and wait
    for it, as the step's last backward does; else only fold the new `.grad` into FSDP2's
    unsharded accumulator (in the reduce dtype, as each backward does). What torch's own
    pipelining does for its REDUCE_GRAD action (`_PipelineStageBase.perform_reduce_grad`,
    torch 2.13): the root's flags, each group's `post_backward`, the root's final callback."""
    root.set_is_last_backward(reduce)
    root.set_requires_gradient_sync(reduce)
    state = root._get_fsdp_state()
    for each in state._state_ctx.all_states:
        for group in _param_groups(each):
            group.post_backward()
    state._root_post_backward_final_callback()


def _resolve(module: str, path: str):
    """The object at `module`.`path` (dotted attributes), or None where any part is missing."""
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


_SHAPES: dict[tuple[Use, object], str | None] = {}  # (use, the object found) -> problem


def _shape_problem(use: Use, obj) -> str | None:
    """What about `obj` no longer fits `use`, or None. Memoized per (use, object): validation
    runs this for every layout a planner search tries, and inspect.signature was a tenth of
    the search's time; a replaced attribute is another object, so it is checked afresh."""
    key = (use, obj)
    if key not in _SHAPES:
        _SHAPES[key] = _check_shape(use, obj)
    return _SHAPES[key]


def _check_shape(use: Use, obj) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None if use.call is None and use.override is None else "has no signature"
    if use.override is not None:
        got = tuple((p.name, p.default) for p in sig.parameters.values())
        if got != use.override:
            want = ", ".join(n if d is _NONE else f"{n}={d!r}" for n, d in use.override)
            return f"is now {sig}, but our override takes exactly ({want})"
    if use.call is not None:
        positional, keywords = use.call
        try:
            sig.bind(*range(positional), **dict.fromkeys(keywords))
        except TypeError as e:
            names = ", ".join([f"<{positional} positional>", *(f"{k}=" for k in keywords)])
            return f"is now {sig}, which no longer takes our call ({names}): {e}"
    return None


def problems() -> tuple[list[str], list[str]]:
    """(errors, absent optional names) of `USES` on this torch."""
    errors, absent = [], []
    for use in USES:
        where = next(
            ((n, o) for n in use.names if (o := _resolve(use.module, n)) is not None), None
        )
        if where is None:
            names = " or ".join(f"{use.module}.{n}" for n in use.names)
            (absent if use.optional else errors).append(
                names if use.optional else f"{names} is missing (used by {use.user})"
            )
            continue
        problem = _shape_problem(use, where[1])
        if problem is not None:
            errors.append(f"{use.module}.{where[0]} {problem} (used by {use.user})")
    return errors, absent


def check_fsdp2() -> list[str]:
    """Raise FSDP2APIError when this torch's FSDP2 lacks, or changed, what ZeRO-3 uses; return
    the optional names that are absent (their features are off)."""
    version = torch.torch_version.TorchVersion(torch.__version__)
    if version < MIN_TORCH:
        raise FSDP2APIError(
            f"parallel.zero_stage=3 runs on torch FSDP2 and needs {SUPPORTED}; this is torch "
            f"{torch.__version__}. Fix: upgrade torch, or use parallel.zero_stage 1 or 2"
        )
    errors, absent = problems()
    if errors:
        raise FSDP2APIError(
            f"parallel.zero_stage=3: torch {torch.__version__}'s FSDP2 is not what megatron_lite "
            f"uses ({SUPPORTED}):\n  - " + "\n  - ".join(errors) + "\nFix: install a torch "
            f"version megatron_lite supports (e.g. {VERIFIED}), update the named user for this "
            "torch, or use parallel.zero_stage 1 or 2 (no FSDP2)"
        )
    return absent
