"""Transformer Engine for the local GEMM of the column/row-parallel linears, and its FP8 recipes.

With `gemm="te"` (model.linear_backend=te) the local GEMM of a parallel linear is a Transformer
Engine `Linear` (its FP8 recipes under `model.fp8`); our layers keep doing the tensor/sequence
parallel communication around it, own the weight (same name, init and checkpoint as the local
backend) and hand it to TE. The FP8 tables are read by config validation and by the model;
`fp8_support` is Transformer Engine's verdict, asked by `megatron_lite.resolve.linear_backend`.
"""

from __future__ import annotations

import torch

from megatron_lite.parallel.params import materialize

# model.fp8_recipe -> the Transformer Engine recipe class (transformer_engine.common.recipe)
FP8_RECIPES = {
    "tensorwise": "Float8CurrentScaling",  # per-tensor scale from the current amax (stateless)
    "delayed": "DelayedScaling",  # per-tensor scale from an amax history
    "blockwise": "Float8BlockScaling",  # 1×128 / 128×128 block scales (Hopper, CUDA ≥ 12.9)
    "mxfp8": "MXFP8BlockScaling",  # 32-element microscaling (Blackwell)
}
FP8_FORMATS = {"e4m3": "E4M3", "hybrid": "HYBRID"}  # hybrid: E4M3 forward, E5M2 gradients


def fp8_support(recipe: str) -> tuple[bool, str]:
    """(supported, reason) from Transformer Engine for this recipe on this GPU and TE version."""
    from transformer_engine.common import recipe as te_recipe

    if not hasattr(te_recipe, FP8_RECIPES[recipe]):
        return False, f"this Transformer Engine version has no {FP8_RECIPES[recipe]} recipe"
    import transformer_engine.pytorch as te

    name = {"blockwise": "fp8_block_scaling", "mxfp8": "mxfp8"}.get(recipe, "fp8")
    if hasattr(te, f"is_{name}_available"):
        return getattr(te, f"is_{name}_available")(return_reason=True)
    from transformer_engine.pytorch import fp8 as te_fp8  # older TE: the checks live here

    return getattr(te_fp8, f"check_{name}_support")()


def fp8_recipe(fmt: str, recipe: str):
    """The Transformer Engine recipe object for model.fp8 / model.fp8_recipe."""
    from transformer_engine.common import recipe as te_recipe

    cls = getattr(te_recipe, FP8_RECIPES[recipe])
    return cls(fp8_format=getattr(te_recipe.Format, FP8_FORMATS[fmt]))


def fp8_autocast(recipe, group):
    """Context in which TE linears run their GEMMs in FP8; `group` reduces amaxes (delayed
    scaling) over the ranks of one pipeline stage (tp×cp×dp)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):  # TE ≥ 2.8
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)


class TELinearGemm:
    """y = x Wᵀ (+ b, added after) through a Transformer Engine Linear without bias or
    communication. TE creates the weight and the calling layer adopts it as its own parameter
    (`self.weight`): one Parameter, registered in TE the way TE registers it (init function,
    fp8 metadata slot), so nothing is swapped into TE. The Linear is kept out of the layer's
    nn.Module tree, so parameter names, init, grad sync and checkpoints are the local backend's.

    TE is built on the meta device, which it documents as deferred initialization: it defers
    only when `device` is the string "meta" (`defer_init=device == "meta"` in TE's Linear;
    a torch.device("meta") does not compare equal, and TE would then allocate the weight on
    CUDA and draw its own init at construction). Then the weight gets uninitialized storage on
    the device the layer is built on, in place (`params.materialize`: the Parameter object TE
    holds is kept); on meta (a model built on meta) it stays there until the model's own
    materialize. The layer's initializer (`params.init_parameters`) draws it, as for `local`."""

    def __init__(self, out_features: int, in_features: int):
        import transformer_engine.pytorch as te

        self.linear = te.Linear(
            in_features,
            out_features,
            bias=False,
            params_dtype=torch.get_default_dtype(),
            device="meta",  # the string: TE's deferred init (see the class docstring)
        )
        self.weight: torch.nn.Parameter = self.linear.weight
        where = torch.empty(0).device  # the default device of this build (meta under a
        if where.type != "meta":  # `with torch.device("meta")` block)
            materialize(self.linear, where)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        if weight is not self.weight:
            raise ValueError(
                "the te linear backend computes with the weight Parameter Transformer Engine "
                "created for this layer, but was given another tensor (the layer's weight was "
                "replaced, e.g. by Module.to_empty or load_state_dict(assign=True), or a "
                "borrowed weight was passed to forward). Fix: fill the weight in place "
                "(copy_, params.materialize), or use gemm='local' for a borrowed weight"
            )
        y = self.linear(x)
        return y if bias is None else y + bias.to(y.dtype)  # as F.linear under autocast

    def train(self, mode: bool = True) -> None:
        self.linear.train(mode)
