"""Fused Triton kernels with plain-torch references (imported as `megatron_lite.kernels`).

Every op computes in fp32, returns the input dtype, and is differentiable w.r.t. its tensor
arguments (cos/sin of `apply_rope` excepted). Dispatch: Triton for CUDA tensors, torch otherwise;
on CUDA a kernel is used only once it passed a one-time self-check against its reference for the
input's shape class, else torch with one warning (selfcheck.py).
`MEGATRON_LITE_KERNELS=triton|torch` forces one, unchecked (read at call time; on CPU `triton`
needs `TRITON_INTERPRET=1`).

The kernels' modules live in the repository's top-level `kernels/` folder, which has no
`__init__.py` on purpose: a top-level folder without one is only a namespace portion, and
Python's import system prefers any regular package of the same name (PEP 420), so `kernels/`
can never shadow the Hugging Face `kernels` package that transformers imports, whatever the
working directory. In a source tree (and an editable install) this package reaches the modules
through `__path__`; a built wheel copies them in beside this file (setup.py).
"""

# ruff: noqa: E402  (the imports below need __path__ set first)
import os as _os

if not _os.path.isfile(_os.path.join(__path__[0], "dispatch.py")):  # a source tree
    _top = _os.path.join(_os.path.dirname(_os.path.dirname(__path__[0])), "kernels")
    __path__.append(_top)

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
