"""`Linear`, `autocast` and `is_fp8_available` with TE's signatures, computed with torch.

`STATS` counts what the model asked for, so a test can check that the TE path really ran.
"""

import contextlib

import torch
import torch.nn.functional as F

STATS = {"linears": 0, "forwards": 0, "fp8_forwards": 0, "autocasts": []}
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


class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
        super().__init__()
        assert not bias, "megatron_lite adds biases itself"
        self.weight = torch.nn.Parameter(
            torch.full((out_features, in_features), float("nan"), dtype=params_dtype, device=device)
        )  # NaN: a model that forgot to hand over its own weight fails loudly
        STATS["linears"] += 1

    def forward(self, x):
        STATS["forwards"] += 1
        w = self.weight
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        recipe = _ACTIVE[-1] if _ACTIVE else None
        if recipe is not None:
            STATS["fp8_forwards"] += 1
            x, w = _round_to_fp8(x, torch.float8_e4m3fn), _round_to_fp8(w, torch.float8_e4m3fn)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, w)
