"""Kernel-test fixtures. On a machine without CUDA the Triton kernels run in the interpreter.

TRITON_INTERPRET is set here at import time, before the test modules import triton; the kernels
are also `triton.jit`-ed at launch (kernels/dispatch.py), so an earlier triton import elsewhere
in the session does not matter.
"""

import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_backend(monkeypatch):
    """Force the Triton path (compiled on CUDA, interpreted on CPU)."""
    monkeypatch.setenv("MEGATRON_LITE_KERNELS", "triton")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """NaN-fill every float tensor from torch.empty / empty_like, so an output element (or a
    partial-sum row) that a kernel forgets to write shows up as NaN in the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(math.nan)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture(autouse=True)
def seed(request):
    """Fresh inputs per test, but reproducible: the seed is a hash of the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
