"""Fused Triton kernels with plain-torch references (imported as `megatron_lite.kernels`).

Every op computes in fp32, returns the input dtype, and is differentiable w.r.t. its tensor
arguments (cos/sin of `apply_rope` excepted). Dispatch: Triton for CUDA tensors, torch otherwise;
on CUDA a kernel is used only once it passed a one-time self-check against its reference for the
input's shape class, else torch with one warning (selfcheck.py).
`MEGATRON_LITE_KERNELS=triton|torch` forces one, unchecked (read at call time; on CPU `triton`
needs `TRITON_INTERPRET=1`).
"""

from megatron_lite.kernels import selfcheck
from megatron_lite.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from megatron_lite.kernels.dispatch import ENV_VAR, use_triton
from megatron_lite.kernels.layer_norm import layer_norm, layer_norm_reference
from megatron_lite.kernels.rms_norm import rms_norm, rms_norm_reference
from megatron_lite.kernels.rope import apply_rope, apply_rope_reference
from megatron_lite.kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "ENV_VAR",
    "apply_rope",
    "apply_rope_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "selfcheck",
    "swiglu",
    "swiglu_reference",
    "use_triton",
]
