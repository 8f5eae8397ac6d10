"""One-time numerical self-check of the compiled Triton kernels before automatic dispatch uses
them (`MEGATRON_LITE_KERNELS` unset or `auto`).

The first time an op meets a new shape class on a device that compiles Triton (CUDA), it runs
its kernels forward and backward on a small input of that dtype and feature size, drawn from a
private generator (the global RNG is untouched), and compares them with the torch reference
within the dtype's tolerance (`TOLERANCES`). A pass is cached for the process: the op runs
Triton from then on. A mismatch or an exception is cached too: that shape class runs the torch
reference in this process, after one warning that names the kernel, dtype, shape class and the
error. `MEGATRON_LITE_KERNELS=triton` forces the kernels without a check, `torch` never runs them.

A shape class is what a compiled kernel is specialized on besides its data: the feature size
(hidden size, head dim, local vocabulary) and the dtypes of the other operands. Each op file
defines its `_self_check(device, dtype, shape_class)`; this module owns the cache, the
tolerances and the comparison. Cost: one small forward + backward per class, once per process
(a few ms once the kernels are compiled, which the first real call would do anyway).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Sequence

import torch

# (atol, rtol) of a kernel's outputs and gradients against its fp32-math torch reference
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}
# one verdict per (kernel, dtype, shape class, device): None passed, else why it failed
_VERDICTS: dict[tuple, str | None] = {}

SelfCheck = Callable[[torch.device, torch.dtype, Hashable], None]


class KernelMismatch(AssertionError):
    """A kernel's output or gradient differs from the torch reference beyond the tolerance."""


def passed(
    kernel: str, dtype: torch.dtype, shape_class: Hashable, device: torch.device, check: SelfCheck
) -> bool:
    """Whether `kernel` matched its reference for this class on `device`: runs `check` the first
    time (a failure warns once and is cached like a pass), then answers from the cache."""
    key = (kernel, dtype, shape_class, device)
    if key not in _VERDICTS:
        _VERDICTS[key] = _run(check, device, dtype, shape_class)
        if _VERDICTS[key] is not None:
            warnings.warn(
                f"megatron_lite.kernels: the Triton {kernel} kernel failed its self-check on "
                f"{device} for {dtype}, shape class {shape_class!r}: {_VERDICTS[key]}. {kernel} "
                "runs the torch reference for these inputs in this process. Report it with the "
                "GPU, torch and triton versions; MEGATRON_LITE_KERNELS=triton forces the kernel "
                "anyway, =torch runs the references everywhere (and silences this)",
                RuntimeWarning,
                stacklevel=4,
            )
    return _VERDICTS[key] is None


def _run(check: SelfCheck, device, dtype, shape_class) -> str | None:
    # eager and in full: whatever the caller's autocast and grad mode (the first call may come
    # from an evaluation under no_grad, or from a recompute inside the backward)
    try:
        with torch.autocast(device.type, enabled=False), torch.enable_grad():
            check(device, dtype, shape_class)
    except Exception as e:  # a compile error, a launch failure, a mismatch: all mean "not this"
        return f"{type(e).__name__}: {str(e).strip()[:300]}"
    return None


def verdicts() -> dict[tuple, str | None]:
    """A copy of this process's verdicts: (kernel, dtype, shape class, device) -> None if the
    kernel passed, else the reason it failed."""
    return dict(_VERDICTS)


def clear() -> None:
    """Forget every verdict (tests; a process never needs it)."""
    _VERDICTS.clear()


# ------------------------------------------------------------------ helpers for the checks
def generator(device: torch.device) -> torch.Generator:
    """A generator of its own for the check's inputs, so the model's RNG streams are untouched."""
    return torch.Generator(device=device).manual_seed(20240)


def sample(shape, dtype, device, gen, requires_grad=True, scale=1.0) -> torch.Tensor:
    """Standard-normal values of `shape` (times `scale`) in `dtype`, optionally a leaf."""
    t = (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise KernelMismatch naming `name` when got and want differ beyond dtype's tolerance (NaN
    where the reference is finite counts as a difference)."""
    atol, rtol = TOLERANCES[dtype]
    g, w = got.detach().float(), want.detach().float()
    if g.shape != w.shape:
        raise KernelMismatch(f"{name}: shape {tuple(g.shape)}, reference {tuple(w.shape)}")
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if bool(bad.any()):
        err = (g - w).abs().nan_to_num(float("inf")).max().item()
        raise KernelMismatch(
            f"{name}: {int(bad.sum())} of {g.numel()} elements differ from the torch reference "
            f"(max abs diff {err:.3g}, tolerance atol {atol:g} + rtol {rtol:g})"
        )


def compare_op(fn, ref, inputs: Sequence, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Forward and backward of `fn` against `ref` on the same inputs, with the same random output
    gradients: every output and the gradient of every input that requires grad."""
    outs, refs = fn(*inputs), ref(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o.dtype != r.dtype:
            raise KernelMismatch(f"output {i}: dtype {o.dtype}, reference {r.dtype}")
    grads = [sample(o.shape, o.dtype, o.device, gen, requires_grad=False) for o in outs]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(refs, leaves, grads)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        compare(f"output {i}", o, r, dtype)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        compare(f"gradient of input {i}", g, w, dtype)
