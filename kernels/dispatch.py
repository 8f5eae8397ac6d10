"""Backend choice for the fused kernels: Triton for CUDA tensors, the torch reference otherwise.

`MEGATRON_LITE_KERNELS=triton|torch|auto` (read at every call, so tests can toggle it) forces
one. Automatic dispatch runs a kernel on CUDA only after it passed its one-time numerical
self-check for the input's shape class (selfcheck.py); forcing `triton` skips the check. On CPU
the Triton path only runs under the Triton interpreter (`TRITON_INTERPRET=1`).

Inside a torch.compile region (model.compile) every op takes the torch reference, whatever the
variable says: inductor fuses the reference into kernels of its own (Triton on a GPU, C++ on a
CPU), and our hand-written kernels and inductor never meet in one graph.
"""

from __future__ import annotations

import os
from collections.abc import Hashable

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor

from megatron_lite.kernels import selfcheck

ENV_VAR = "MEGATRON_LITE_KERNELS"
_CHOICES = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HIDDEN = 65536  # norms keep one row in registers; wider rows would need a looped kernel


def interpret_enabled() -> bool:
    """Whether Triton kernels run in the CPU interpreter (`TRITON_INTERPRET`), read right now."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older versions read the env var
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def is_fake(x) -> bool:
    """Whether `x` is a fake tensor (a dry run's: shapes, no data). The kernels' one private
    torch call (they import nothing of the package, so not megatron_lite.parallel.fake)."""
    return isinstance(x, FakeTensor)


def launch(kernel, grid, *args, **meta) -> None:
    """`kernel[grid](*args, **meta)`; nothing when a tensor argument is fake: a dry run has no
    data to compute, and the outputs the caller allocated are what it measures."""
    if any(is_fake(a) for a in args):
        return
    kernel[grid](*args, **meta)


def compiles_triton(x: torch.Tensor) -> bool:
    """Whether `x` lives where Triton kernels run compiled (CUDA), which is where automatic
    dispatch picks them. A module attribute, so tests can say yes for CPU tensors and drive
    the self-check through the interpreter."""
    return x.is_cuda


def use_triton(
    x: torch.Tensor, kernel: str, shape_class: Hashable, check: selfcheck.SelfCheck
) -> bool:
    """True when the op `kernel` on tensor `x` should run the Triton kernels, False for torch.

    Automatic dispatch: Triton where `compiles_triton(x)` and the dtype is one the kernels
    take, once `check(device, dtype, shape_class)` passed (run once per process and class,
    selfcheck.py); forced `triton`: always, unchecked; `torch`: never."""
    if torch.compiler.is_compiling():  # inductor generates the kernels (module docstring)
        return False
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(
            f"{ENV_VAR}={choice!r} is not one of {', '.join(_CHOICES)}: unset it for automatic "
            "dispatch (Triton on CUDA tensors once self-checked, torch otherwise) or set one of "
            "those values"
        )
    if choice == "torch":
        return False
    if choice == "auto":
        # fp64 (exact parity tests) stays on the torch reference, which computes in fp64
        if not (compiles_triton(x) and x.dtype in TRITON_DTYPES):
            return False
        # a dry run's fake tensors have no values to check: they measure the GPU's kernels
        return is_fake(x) or selfcheck.passed(kernel, x.dtype, shape_class, x.device, check)
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"{ENV_VAR}=triton: the Triton kernels take {', '.join(map(str, TRITON_DTYPES))}, "
            f"not {x.dtype}; unset {ENV_VAR} (fp64 then runs the torch reference) or cast"
        )
    if is_fake(x):  # a dry run of the GPU's kernels: they allocate, launch() skips the math
        return True
    if not x.is_cuda and not interpret_enabled():
        raise RuntimeError(
            f"{ENV_VAR}=triton was requested for a tensor on {x.device}, but Triton kernels only "
            "run on CUDA devices or in the Triton interpreter: set TRITON_INTERPRET=1 (before "
            f"triton is first imported) to run them on CPU, or set {ENV_VAR}=torch"
        )
    if interpret_enabled() and not _interpreter_ready():
        raise RuntimeError(
            "TRITON_INTERPRET=1 is set, but triton was imported before it was: triton.language's "
            "own helpers (tl.sum, tl.max, ...) were compiled for a GPU at import and cannot run "
            "in the interpreter. Set TRITON_INTERPRET=1 before the first `import triton` (in the "
            f"shell, or first thing in a conftest), or set {ENV_VAR}=torch"
        )
    return True


def _interpreter_ready() -> bool:
    # triton.jit picks compiler or interpreter when it decorates, so the standard library
    # is interpretable only if TRITON_INTERPRET was set when triton was imported
    return type(tl.sum).__name__ == "InterpretedFunction"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The references' math dtype: fp32, or fp64 for fp64 inputs (never below fp32)."""
    return torch.promote_types(dtype, torch.float32)


def num_warps_for(block: int) -> int:
    """Warps per program for a row of `block` elements: enough to keep ~8 elements per thread."""
    return int(min(max(block // 256, 4), 16))


def num_programs(x: torch.Tensor, rows: int) -> int:
    """Programs for a row-blocked reduction (norm backward): a few per SM, at most one per row."""
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(min(rows, 4 * sms), 1)
    return max(min(rows, 4), 1)  # the interpreter runs programs one after another anyway


def norm_check_rows(device: torch.device, h: int) -> int:
    """Rows of a norm's self-check input: enough that each backward program walks two or more
    rows, as at full size (2·programs + 1), but at most ~4M elements."""
    programs = num_programs(torch.empty(0, device=device), 1 << 30)
    return max(3, min(2 * programs + 1, (1 << 22) // h))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., h] -> [rows, h] with unit stride along h (copies only when it must)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()
