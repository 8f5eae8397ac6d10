"""The one place that touches torch's fake tensors (a private API): the dry run
(plan --dry-run) runs the real code under `FakeTensorMode`, whose tensors carry shapes, dtypes
and devices but no data, and this module answers the few questions the code asks of them
(`is_fake`, `active`, `real_tensors`: dry-run seams; parallel/dry_run_seams.py lists every
call site and why, and a test keeps that list complete)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["FakeTensorMode", "active", "cuda_on_host", "is_fake", "real_tensors"]


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a dry run's fake tensor (no data: host reads must not touch it)."""
    return isinstance(t, FakeTensor)


def active() -> bool:
    """Whether the code runs under a FakeTensorMode (a dry run)."""
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def real_tensors():
    """A context in which tensors are real even under a dry run (a DeviceMesh's rank table
    must be: it is read on the host); a no-op outside one."""
    return unset_fake_temporarily()


@contextlib.contextmanager
def cuda_on_host() -> Iterator[None]:
    """Inside the block a fake CUDA tensor is on CUDA to Python (`.device`, `.is_cuda`) and on
    the CPU to torch's C++ (autograd, the device guards of the Python bindings): a CPU-only
    torch has no CUDA device guard, so autograd aborts on a tensor whose C++ device is CUDA.
    The CUDA dry run's (plan/fake_cuda.py); the C++ side's `.to()`/`.cpu()` then sees no
    device change, which fake_cuda routes through the dispatcher."""
    handlers = fake_tensor._DISPATCH_META_HANDLERS
    key = torch.ops.prim.device.default
    device = handlers[key]

    def host_device(args):
        d = device(args)
        return torch.device("cpu") if d.type == "cuda" else d

    handlers[key] = host_device
    FakeTensor.is_cuda = property(lambda t: t.fake_device.type == "cuda")
    try:
        yield
    finally:
        handlers[key] = device
        del FakeTensor.is_cuda
