"""The one place that touches torch's fake tensors (a private API): the dry run
(plan --dry-run) runs the real code under `FakeTensorMode`, whose tensors carry shapes, dtypes
and devices but no data, and this module answers the few questions the code asks of them
(`is_fake`, `active`, `real_tensors`: dry-run seams; parallel/dry_run_seams.py lists every
call site and why, and a test keeps that list complete)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["FakeTensorMode", "active", "is_fake", "real_tensors"]


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
