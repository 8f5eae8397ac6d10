"""`Linear`, `autocast` and `is_fp8_available` with TE's signatures, computed with torch.

`STATS` counts what the model asked for, so a test can check that the TE path really ran.
"""

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

STATS = {
    "linears": 0,
    "deferred": 0,  # built with device="meta": no storage, nothing drawn
    "materialized_on_cuda": 0,  # reset_parameters moved a meta weight to "cuda"
    "forwards": 0,
    "fp8_forwards": 0,
    "autocasts": [],
}
_ACTIVE = []  # the recipe of the innermost autocast


def is_fp8_available(return_reason=False):
    return (True, "") if return_reason else True


def _round_to_fp8(t: torch.Tensor, dtype) -> torch.Tensor:
    """Quantize-dequantize with one scale per tensor from its current amax; the gradient
    passes straight through."""
    t32 = t.float()
    scale = torch.finfo(dtype).max / t32.abs().amax().clamp(min=1e-12)
    q = (t32 * scale).to(dtype).float() / scale
    return t + (q.to(t.dtype) - t).detach()


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
    ranks = tuple(torch.distributed.get_process_group_ranks(amax_reduction_group))
    STATS["autocasts"].append((type(recipe).__name__, recipe.fp8_format.name, ranks))
    _ACTIVE.append(recipe if enabled else None)
    try:
        yield
    finally:
        _ACTIVE.pop()
    if type(recipe).__name__ == "DelayedScaling":  # TE reduces amaxes as the region ends
        amax = torch.ones(1)
        torch.distributed.all_reduce(amax, torch.distributed.ReduceOp.MAX, amax_reduction_group)


GEMM1_WEIGHT = 1  # tex.FP8FwdTensors.GEMM1_WEIGHT: the weight's slot in the fp8 metadata


def _default_init(t):  # TE's get_default_init_method(): init_method_normal(0.023)
    return torch.nn.init.normal_(t, mean=0.0, std=0.023)


@dataclasses.dataclass
class _ParameterInitMeta:  # TE's record of how to (re)initialize a parameter later
    init_fn: object = None
    get_rng_state_tracker: object = None
    fp8_meta_index: int | None = None

    def __post_init__(self):
        if self.init_fn is None:
            self.init_fn = _default_init


class Linear(torch.nn.Module):
    """TE's `Linear(in, out, bias, params_dtype, device)` as far as parameters go, after
    TransformerEngineBaseModule and Linear.__init__ (TE 1.x-2.x): the weight is allocated on
    `device` and registered through `register_parameter`, which records its init function and
    fp8 metadata slot; then `reset_parameters(defer_init=device == "meta")`. Note the string
    comparison: only the string "meta" defers; any other device, a torch.device("meta")
    included, materializes meta parameters on "cuda" and draws TE's default init there.
    Assigning a Parameter attribute later goes through register_parameter again (torch's
    Module.__setattr__), with default metadata. fp8 metadata is created lazily, at the first
    forward inside autocast, as TE does."""

    def __init__(
        self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kwargs
    ):
        super().__init__()
        assert not bias, "megatron_lite adds biases itself"
        self.param_init_meta = {}
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        weight = torch.empty(out_features, in_features, device=device, dtype=params_dtype)
        self.register_parameter(
            "weight",
            torch.nn.Parameter(weight),
            init_fn=kwargs.get("init_method"),
            fp8_meta_index=GEMM1_WEIGHT,
        )
        self.reset_parameters(defer_init=device == "meta")
        STATS["linears"] += 1
        STATS["deferred"] += device == "meta"

    def register_parameter(self, name, param, **kwargs):
        super().register_parameter(name, param)
        self.param_init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init=False):
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            if param.device == torch.device("meta"):
                STATS["materialized_on_cuda"] += 1
                param = torch.empty_like(param, device="cuda")  # fails on a CPU-only torch
            self.param_init_meta[name].init_fn(param)
            setattr(self, name, torch.nn.Parameter(param))

    def forward(self, x):
        STATS["forwards"] += 1
        w = self.weight  # TE reads its weights by name (Linear._get_weight_tensors)
        if w.is_meta:  # TE's contract: "all parameters moved to the GPU before forward"
            raise RuntimeError("stand-in TE Linear: forward with its weight still on meta")
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        recipe = _ACTIVE[-1] if _ACTIVE else None
        if recipe is not None:
            if not self.fp8_meta_tensors_initialized:  # TE: init_fp8_metadata at first use
                self.fp8_meta["recipe"], self.fp8_meta_tensors_initialized = recipe, True
            STATS["fp8_forwards"] += 1
            x, w = _round_to_fp8(x, torch.float8_e4m3fn), _round_to_fp8(w, torch.float8_e4m3fn)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, w)
