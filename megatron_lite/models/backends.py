"""Attention and linear backends: torch SDPA and F.linear (everywhere), flash-attn and
Transformer Engine (CUDA only, from the optional `[gpu]` extra).

`resolve_attention_backend` and `resolve_linear_backend` run in the hardware check, before any
process group exists: asking for a backend that is not installed or not usable on this machine is
an error naming the package and how to install it; `auto` picks flash-attn only where it computes
the same math up to dtype rounding (CUDA, bf16 training), else SDPA.

With `model.linear_backend=te` the local GEMM of every column/row-parallel linear in the
transformer layers is a Transformer Engine `Linear` (its FP8 recipes under `model.fp8`); our
layers keep doing the tensor/sequence-parallel communication around it, own the weight (same
name, init and checkpoint as the local backend) and hand it to TE.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

INSTALL = {
    "flash": (
        "flash_attn",
        "pip install flash-attn --no-build-isolation (or pip install -e "
        "'.[gpu]') on a CUDA machine",
    ),
    "te": (
        "transformer_engine",
        "pip install 'transformer-engine[pytorch]' (or pip install -e '.[gpu]') on a CUDA machine",
    ),
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    return torch.cuda.is_available()


def _require_cuda_package(key: str, requested: str, instead: str) -> None:
    """The GPU backend `requested` for config `key` needs CUDA and its package (INSTALL)."""
    module, how = INSTALL[requested]
    if not _cuda():
        raise ValueError(
            f"{key}={requested!r} needs a CUDA GPU and {module}; this machine has no GPU. "
            f"Fix: use {instead}"
        )
    if not _installed(module):
        raise ValueError(
            f"{key}={requested!r} needs the package {module}, which is not installed. "
            f"Fix: {how}, or use {instead}"
        )


def resolve_attention_backend(requested: str, precision: str) -> str:
    """auto|sdpa|flash|te -> the backend to use; raises ValueError(message) when unusable."""
    if requested == "auto":
        # flash-attn has no fp32 kernels: in fp32 training it would change the math
        return "flash" if _cuda() and precision == "bf16" and _installed("flash_attn") else "sdpa"
    if requested in INSTALL:
        _require_cuda_package(
            "model.attention_backend", requested, "model.attention_backend=sdpa (or auto)"
        )
        if requested == "flash" and precision != "bf16":
            raise ValueError(
                "model.attention_backend='flash' computes in bf16/fp16 only. Fix: "
                "set train.precision=bf16, or use sdpa"
            )
    return requested


def sdpa_attention(q, k, v, dropout_p: float) -> torch.Tensor:
    """Causal attention. q [s, b, n, d], k/v [s, b, g, d] (n % g == 0) -> [s, b, n, d]."""
    gqa = k.shape[2] != q.shape[2]  # each KV head serves n/g query heads, without copies
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
    )
    return out.permute(2, 0, 1, 3)


def flash_attention(q, k, v, dropout_p: float) -> torch.Tensor:
    """flash-attn (GQA native). [s, b, heads, d] -> [s, b, n, d]."""
    from flash_attn import flash_attn_func

    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
    return flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True).transpose(0, 1)


class TEAttention(torch.nn.Module):
    """Transformer Engine DotProductAttention on [s, b, heads, d] tensors."""

    def __init__(self, n_local: int, g_local: int, head_dim: int, dropout_p: float):
        super().__init__()
        import transformer_engine.pytorch as te

        self.n = n_local
        self.attn = te.DotProductAttention(
            n_local,
            head_dim,
            num_gqa_groups=g_local,
            attention_dropout=dropout_p,
            qkv_format="sbhd",
            attn_mask_type="causal",
        )

    def forward(self, q, k, v, dropout_p: float) -> torch.Tensor:
        q, k, v = (t.contiguous() for t in (q, k, v))  # Ulysses hands over head-sliced views
        out = self.attn(q, k, v)  # [s, b, n·d]
        return out.view(*q.shape[:2], self.n, -1)


def attention_function(backend: str, n_local: int, g_local: int, head_dim: int, dropout_p: float):
    """A callable (q, k, v, dropout_p) -> out for `backend` (already resolved)."""
    if backend == "flash":
        return flash_attention
    if backend == "te":
        return TEAttention(n_local, g_local, head_dim, dropout_p)
    return sdpa_attention


# model.fp8_recipe -> the Transformer Engine recipe class (transformer_engine.common.recipe)
FP8_RECIPES = {
    "tensorwise": "Float8CurrentScaling",  # per-tensor scale from the current amax (stateless)
    "delayed": "DelayedScaling",  # per-tensor scale from an amax history
    "blockwise": "Float8BlockScaling",  # 1×128 / 128×128 block scales (Hopper, CUDA ≥ 12.9)
    "mxfp8": "MXFP8BlockScaling",  # 32-element microscaling (Blackwell)
}
FP8_FORMATS = {"e4m3": "E4M3", "hybrid": "HYBRID"}  # hybrid: E4M3 forward, E5M2 gradients


def resolve_linear_backend(requested: str, fp8: str | None, recipe: str = "tensorwise") -> str:
    """local|te -> the backend; raises ValueError(message) when TE or FP8 is unusable here."""
    if requested == "local":
        return requested
    _require_cuda_package("model.linear_backend", requested, "model.linear_backend=local")
    if fp8 is not None:
        ok, reason = _fp8_support(recipe)
        if not ok:
            raise ValueError(
                f"model.fp8_recipe={recipe!r}: Transformer Engine says it cannot run here "
                f"({reason}). Fix: pick another model.fp8_recipe (tensorwise and delayed need "
                "Hopper or Ada; blockwise Hopper and CUDA >= 12.9; mxfp8 Blackwell), upgrade "
                "transformer-engine, or set model.fp8=null for bf16 GEMMs through TE"
            )
    return requested


def _fp8_support(recipe: str) -> tuple[bool, str]:
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
    communication, computing with the `weight` that the calling layer owns. Kept out of the
    nn.Module tree, so parameter names, init, grad sync and checkpoints are the local backend's."""

    def __init__(self, weight: torch.nn.Parameter):
        import transformer_engine.pytorch as te

        out_features, in_features = weight.shape
        self.linear = te.Linear(
            in_features,
            out_features,
            bias=False,
            params_dtype=weight.dtype,
            device=weight.device,
        )
        self.linear.weight = weight  # TE reads its weight by name at every forward

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        if self.linear.weight is not weight:  # the layer's parameter object was replaced
            if not isinstance(weight, torch.nn.Parameter):
                raise TypeError(
                    "the te linear backend computes with a layer's own weight Parameter; "
                    "pass none (or use gemm='local' for a borrowed plain tensor)"
                )
            self.linear.weight = weight
        y = self.linear(x)
        return y if bias is None else y + bias.to(y.dtype)  # as F.linear under autocast

    def train(self, mode: bool = True) -> None:
        self.linear.train(mode)
