"""Optional GPU packages (flash-attn, Transformer Engine from the `[gpu]` extra): the install
hint for each and the one check that a requested GPU backend can run on this machine.

Backends are resolved in the hardware check, before any process group exists: asking for one
that is not installed or not usable here is an error naming the package and how to install it.
"""

from __future__ import annotations

import importlib.util

import torch

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


def require_cuda_package(key: str, requested: str, instead: str) -> None:
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
