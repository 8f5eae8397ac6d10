"""Reading device values on the host: the dry run's main seam.

The training step reads a few values back to Python (the global token count, the reduced loss
and gradient norm, the MoE token counts that size the all-to-all). A dry run (plan --dry-run)
runs the same code on fake tensors, which have shapes but no values; there `read` returns the
caller's `nominal` instead: what the step assumes when it has nothing to read (a finite loss,
balanced routing, the full token count). parallel/dry_run_seams.py lists every caller and why
(a test keeps that list complete), with the other seams (parallel/fake.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_lite.parallel import fake


def read(t: torch.Tensor, nominal: Any | Callable[[], Any]) -> Any:
    """`t.tolist()` (a Python number for a 0-d tensor); under a dry run, `nominal` (called if
    callable), which must have the same structure."""
    if fake.is_fake(t):
        return nominal() if callable(nominal) else nominal
    return t.tolist()
