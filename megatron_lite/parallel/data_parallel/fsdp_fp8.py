"""FP8 all-gather of weights under ZeRO-3 (model.fp8=tensorwise, model.fp8_all_gather=true):
each FP8 linear's sharded fp32 master is wrapped in `Fp8GatherWeight`, whose FSDP2 extension
hooks (`fsdp_pre_all_gather` / `fsdp_post_all_gather`) cast this rank's shard to E4M3 before
the all-gather and hand the layer the gathered torchao `Float8TrainingTensor`: one byte per
element on the wire instead of bf16's two, and no bf16 copy of the weight in between.

The same idea as torchao's `WeightWithDynamicFloat8CastTensor`, written here because its
scale is reduced over the FSDP mesh only: our column/row-parallel weights are TP shards as
well, and a tensorwise scale spans the whole weight. So the amax is max-reduced over the
FSDP shard group and over TP (each a small all-reduce counted as `fp8_amax`), and the scale
is the one a run without the extension computes from the gathered bf16 weight. The shard is
first rounded to the compute dtype (bf16), as FSDP2 does before a plain gather: casting
before or after the gather with one global scale gives the same FP8 bytes, so the step equals
the bf16-gather FP8 step bitwise (tests/parallel/test_fp8_all_gather.py).

Tensorwise only: a rowwise weight is cast twice with different scales (per output row for
the forward, per input column for the dgrad), so no single FP8 copy serves both GEMMs; those
weights, the experts' and the fp8_skip ones gather bf16.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from megatron_lite.parallel import mappings
from megatron_lite.parallel.fp8 import Fp8Gemm, _torchao, recipe_config

# FSDP2 pads and shards its local tensor with these (as torchao's list): they keep the subclass
_PRESERVE = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class Fp8GatherWeight(torch.Tensor):
    """A weight (the fp32 master, or FSDP2's shard of it) that FSDP2 all-gathers in FP8 with
    `gemm`'s tensorwise scale (see the module docstring). Every other op sees the plain tensor."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, gemm: Fp8Gemm):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, gemm: Fp8Gemm):
        self._tensor, self._gemm = tensor, gemm

    def __repr__(self):
        return f"Fp8GatherWeight({self._tensor!r}, {self._gemm.recipe})"

    def __reduce_ex__(self, protocol):
        # pickled (a checkpoint's tensors, sliced and cast from the shard) as the plain tensor
        # inside: a checkpoint holds values, not this wrapper or its process groups
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_tensor"], {"gemm": self._gemm}

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return Fp8GatherWeight(inner["_tensor"], spec["gemm"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        gemm = next(a._gemm for a in pytree.tree_leaves(args) if isinstance(a, cls))
        if func is torch.ops.aten.detach.default:
            return cls(args[0]._tensor.detach(), gemm)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, gemm), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard [rows/N, in] -> (its E4M3 values as uint8,), (the global scale,
        the FP8 dtype)."""
        config, ftt, utils = _torchao()
        c, mm = recipe_config(self._gemm.recipe)
        cast = c.cast_config_weight
        hp = self._tensor.to(mp_policy.param_dtype or self._tensor.dtype)  # FSDP2's rounding
        if hp.numel():
            amax = utils.tensor_to_amax(hp, False, None, cast.scaling_granularity, None).float()
        else:  # a shard of padding only
            amax = torch.zeros((), dtype=torch.float32, device=hp.device)
        for group in (mesh.get_group(mesh.ndim - 1), self._gemm.group):
            if mappings.size(group) > 1:  # the whole weight's amax (module docstring)
                op = torch.distributed.ReduceOp.MAX
                amax = mappings.all_reduce(amax.contiguous(), group, op, "fp8_amax")
        scale = utils.amax_to_scale(amax, cast.target_dtype, c.round_scales_to_power_of_2)
        role = ftt.GemmInputRole.WEIGHT
        fp8 = ftt.hp_tensor_and_scale_to_float8(hp, scale, cast.target_dtype, mm, role)
        # as bytes: gloo has no FP8 all-gather (the same bytes on NCCL)
        return (fp8._data.view(torch.uint8),), (scale, fp8._data.dtype)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered E4M3 bytes [rows, in] and the scale -> the layer's Float8TrainingTensor
        weight (the same tensor refilled after a reshard, `out`)."""
        ftt = _torchao()[1]
        (data,), (scale, fp8_dtype) = outputs, metadata
        if out is not None:  # its _data views the refilled bytes already
            out._scale = scale
            return None
        _, mm = recipe_config(self._gemm.recipe)
        role = ftt.GemmInputRole.WEIGHT
        weight = ftt.Float8TrainingTensor(data.view(fp8_dtype), scale, param_dtype, mm, role)
        return weight, (data,)


def gathers_fp8(module: torch.nn.Module) -> bool:
    """Whether `module` is a linear whose weight ZeRO-3 should gather in FP8 (apply_fp8 set a
    tensorwise Fp8Gemm with all_gather on it)."""
    gemm = getattr(module, "fp8", None)
    return isinstance(gemm, Fp8Gemm) and gemm.all_gather and gemm.recipe == "tensorwise"


def wrap_fp8_weights(chunk: torch.nn.Module) -> int:
    """Before fully_shard: give each FP8-gathered linear's weight (fp32 by then) the
    Fp8GatherWeight form, keeping its metadata. Returns how many were wrapped."""
    n = 0
    for m in chunk.modules():
        if gathers_fp8(m) and not isinstance(m.weight.data, Fp8GatherWeight):
            old = m.weight
            new = torch.nn.Parameter(Fp8GatherWeight(old.data, m.fp8), old.requires_grad)
            if hasattr(old, "meta"):
                new.meta = old.meta
            m.weight = new
            n += 1
    return n
