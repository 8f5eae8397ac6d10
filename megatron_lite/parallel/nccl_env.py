"""Defaults for NCCL's own watchdog and flight recorder, set before the first NCCL process group
is created and only where the user has not set the variable (under any of its names):

- TORCH_NCCL_ASYNC_ERROR_HANDLING=3: on a watchdog timeout (the group's timeout,
  parallel.timeout_s) or an NCCL error, end the process without aborting the communicators (1
  aborts them first, which can cut the flight recorder's dump short: pytorch#121055).
- TORCH_FR_BUFFER_SIZE=2000 (TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.9): entries in the
  flight recorder's ring of each rank's recent collectives and P2P ops (0 turns it off).
- TORCH_NCCL_DUMP_ON_TIMEOUT=1: on a timeout or NCCL error, each rank writes its ring out.
- TORCH_FR_DUMP_TEMP_FILE=<out_dir>/nccl_trace_rank_ (TORCH_NCCL_DEBUG_INFO_TEMP_FILE before
  2.9): the dump's path prefix, the global rank appended (read it with torch's fr_trace tool).

torch 2.9 renamed the two flight recorder variables; it still reads the old names, with a
deprecation warning, so the name this torch reads first is the one set. torchrun puts
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 into its workers' environment unless its own environment has
the variable: export it before torchrun to get 3 there.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from torch.torch_version import TorchVersion

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # (since 2.9, before)
DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def nccl_env_defaults(dump_prefix: str, torch_version: str = torch.__version__) -> dict:
    """{names: default}: each key is the tuple of a variable's names, the one `torch_version`
    reads first leading."""
    new = TorchVersion(torch_version) >= (2, 9)
    buffer, dump = (BUFFER_SIZE, DUMP_FILE) if new else (BUFFER_SIZE[::-1], DUMP_FILE[::-1])
    return {
        (ASYNC_ERROR_HANDLING,): "3",
        buffer: "2000",
        (DUMP_ON_TIMEOUT,): "1",
        dump: dump_prefix,
    }


def set_nccl_env_defaults(
    environ: MutableMapping[str, str], dump_prefix: str, torch_version: str = torch.__version__
) -> dict[str, str]:
    """Set in `environ` each default of `nccl_env_defaults` whose variable is absent under all
    its names; returns {name: value} of what it set."""
    added = {}
    for names, value in nccl_env_defaults(dump_prefix, torch_version).items():
        if not any(n in environ for n in names):
            environ[names[0]] = added[names[0]] = value
    return added
