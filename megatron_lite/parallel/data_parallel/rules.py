"""The rules on data-parallel settings, one function each, shared by the two entry points: the
Python API (`build_data_parallel`, `DataParallel`, `FullyShardedDataParallel`: arguments.py)
and the config path (validation/data_parallel.py, which maps its keys onto these functions).

A rule function returns None when the value is fine, else the rule it breaks as text (e.g.
"must be >= 1 (elements per gradient bucket)"); each entry point words the message with its
own name for the value (`bucket_size`, `parallel.ddp_bucket_size`) and its own fix. Numbers
the optimizer keeps in fp32 (lr, betas, eps, weight decay) are checked in fp32: 1e39 is a
finite float64 but inf in fp32. Pure Python: no tensors (the dry run checks under fake modes).
"""

from __future__ import annotations

import math
import numbers
import os
import struct
import tempfile

import torch

FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
# the dtypes gradients may travel in, by the config's names for them (parallel.grad_reduce_dtype)
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the dtypes weights may compute in: fp16 would need loss scaling, which nothing here does
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
ZERO_STAGES = (
    "must be one of the ints 0 (replicated optimizer), 1 (distributed optimizer), 2 (and "
    "sharded gradients) or 3 (and sharded parameters, torch FSDP2)"
)


def is_int(value) -> bool:
    """An integer that is not a bool (True == 1 would pass for a stage or a size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number that is not a bool (ints and floats, numpy's too)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def in_fp32(value: float) -> float:
    """`value` rounded to fp32 (inf beyond its range), as the optimizer's state holds it."""
    try:
        return struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def fp32_number(value) -> str | None:
    """A number that stays finite in fp32."""
    if not is_real(value):
        return f"must be a number (int or float), not {type(value).__name__}"
    if not (math.isfinite(value) and math.isfinite(in_fp32(value))):
        return (
            f"must be a finite number within fp32's range (|x| <= {FP32_MAX:.4g}): the "
            "optimizer computes with it in fp32"
        )
    return None


def positive_fp32(value) -> str | None:
    """lr, eps: > 0, also once rounded to fp32 (eps 1e-50 is 0 there: a zero denominator)."""
    if problem := fp32_number(value):
        return problem
    if value <= 0:
        return "must be > 0"
    if in_fp32(value) == 0:
        return f"must be > 0 in fp32, the optimizer's dtype, where {value!r} rounds to 0"
    return None


def beta(value) -> str | None:
    """An AdamW beta: in [0, 1), also once rounded to fp32 (0.99999999 is 1.0 there)."""
    if problem := fp32_number(value):
        return problem
    if not 0 <= value < 1:
        return "must be in [0, 1)"
    if in_fp32(value) >= 1:
        return f"must be in [0, 1) in fp32, the optimizer's dtype, where {value!r} rounds to 1.0"
    return None


def betas_pair(value) -> str | None:
    """The pair (beta1, beta2) itself (each element then by `beta`)."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        return "must be a pair (beta1, beta2)"
    return None


def weight_decay(value, lr) -> str | None:
    """>= 0 and finite; with a valid lr, lr·weight_decay < 1: decoupled decay scales the
    weights by 1 - lr·weight_decay every step, so 1 or more zeroes or flips them."""
    if problem := fp32_number(value):
        return problem
    if value < 0:
        return "must be >= 0"
    if positive_fp32(lr) is None and lr * value >= 1:
        return (
            f"lr·weight_decay = {lr!r}·{value!r} = {lr * value:.4g} must be < 1 (each step "
            "scales the weights by 1 - lr·weight_decay)"
        )
    return None


def zero_stage(value) -> str | None:
    return None if is_int(value) and value in (0, 1, 2, 3) else ZERO_STAGES


def bucket_size(value) -> str | None:
    if not is_int(value):
        return f"must be an int (elements per gradient bucket), not {type(value).__name__}"
    return None if value >= 1 else "must be >= 1 (elements per gradient bucket)"


def flag(value) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def reduce_dtype(value) -> str | None:
    """What gradients travel in: torch.float32 or torch.bfloat16 (the optimizer steps in fp32
    either way). The config's strings are not aliases here: one spelling per surface."""
    if value in REDUCE_DTYPES.values() and isinstance(value, torch.dtype):
        return None
    if isinstance(value, str):
        return "must be a torch.dtype (the config's strings are for parallel.grad_reduce_dtype)"
    return (
        "must be torch.float32 or torch.bfloat16 (the dtypes gradients are reduced in; an "
        "integer dtype truncates them, fp16 needs loss scaling)"
    )


def weight_dtype(value) -> str | None:
    """What the weights compute in (the optimizer keeps fp32 masters either way)."""
    if value in WEIGHT_DTYPES:
        return None
    if value == torch.float16:
        return (
            "fp16 weights need loss scaling, which megatron_lite does not do (bf16 has fp32's "
            "range)"
        )
    return "must be torch.float32 or torch.bfloat16"


OFFLOADS = {False: "none", True: "cpu", "none": "none", "cpu": "cpu", "nvme": "nvme"}


def offload_kind(value) -> str:
    """The offload's name ("none", "cpu", "nvme") of a checked value (`offload_value`)."""
    return OFFLOADS[value]


def offload_value(value) -> str | None:
    """False / True (the host) or "none", "cpu", "nvme"."""
    ok = isinstance(value, bool | str) and value in OFFLOADS
    return None if ok else 'must be False, True (= "cpu"), "cpu" or "nvme"'


def offload(value, stage) -> str | None:
    """Optimizer offload steps the optimizer on the host: stages 0-2 only."""
    if offload_value(value) is None and offload_kind(value) != "none" and stage == 3:
        return (
            "optimizer offload is for zero_stage 0-2 (cpu and nvme alike); stage 3 shards "
            "the optimizer states over the data-parallel ranks instead (FSDP2 steps them on "
            "the device)"
        )
    return None


def nvme_path(value) -> str | None:
    """An existing directory this process can create, write and remove files in (the one rule
    here that looks at the filesystem)."""
    if not isinstance(value, str) or not value:
        return "must name a directory for the swap files (NVMe offload needs one)"
    if not os.path.exists(value):
        return "does not exist"
    if not os.path.isdir(value):
        return "is not a directory"
    try:  # a read-only mount, a full disk or missing permissions show here (root passes access)
        with tempfile.NamedTemporaryFile(dir=value, prefix=".megatron_lite_probe") as f:
            f.write(b"\0")
            f.flush()
    except OSError as e:
        return f"is not writable ([Errno {e.errno}] {e.strerror})"
    return None


def nvme_buffer_mb(value) -> str | None:
    if not is_int(value):
        return f"must be an int (MiB of the host buffer), not {type(value).__name__}"
    return None if value >= 1 else "must be >= 1 (MiB of the host buffer)"


def dp_shard_value(value) -> str | None:
    """None (the whole group) or a positive int."""
    if value is None:
        return None
    if not is_int(value):
        return f"must be an int or None (None: the whole group), not {type(value).__name__}"
    return None if value >= 1 else "must be >= 1 (or None for the whole group)"


def dp_shard_stage(value, stage) -> str | None:
    """Hybrid sharding shards the optimizer, so it needs a sharding stage."""
    if value is not None and stage == 0:
        return "hybrid sharding shards the optimizer, which zero_stage 0 replicates"
    return None


def dp_shard_divides(value, groups: dict[str, int]) -> str | None:
    """`value` divides every reduction group it shards, `groups`: description -> ranks."""
    for what, size in groups.items():
        if value is not None and size % value:
            return f"must divide {what} ({size} ranks)"
    return None
