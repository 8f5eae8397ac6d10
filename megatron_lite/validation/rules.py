"""The checks every validation rule is written with: a predicate, an enumerated choice, a number
checked in the dtype it is stored in, a timeout, and the one-line warning of a key that has no
effect."""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import threading
from datetime import timedelta

import torch

from megatron_lite.config import ConfigError

# the longest timeout every consumer takes: thread joins (threading.TIMEOUT_MAX, about 292
# years) and datetime.timedelta (the process groups' timeouts)
MAX_TIMEOUT_S = min(threading.TIMEOUT_MAX, timedelta.max.total_seconds())
# set by the process that showed a config's warnings (value: their digest), inherited by the
# processes it starts (launch -> torchrun -> ranks), so each warning is shown once per run
WARNED_ENV = "MEGATRON_LITE_CONFIG_WARNED"


def _rule(ok: bool, key: str, value, rule: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {rule}. Fix: {fix}.")


def _choice(key: str, value, choices: tuple) -> None:
    _rule(
        value in choices,
        key,
        value,
        f"must be one of {', '.join(map(str, choices))}",
        f"set {key} to one of them",
    )


@functools.lru_cache(maxsize=4096)  # a planner search validates ~10^4 layouts of one config
def in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (round to nearest even; inf beyond its range), as a tensor of
    that dtype holds it."""
    return torch.tensor(float(value), dtype=torch.float64).to(dtype).item()


def _stored(key: str, value: float | None, dtype: torch.dtype, why: str, fix: str) -> None:
    """A float key that becomes tensor state or tensor math in `dtype` (`why`: where): finite
    there, and not rounded to 0 when it is not 0 (1e308 is a finite float64 but inf in fp32;
    1e-50 is 0 there). Its own range (>= 0, > 0) is the caller's rule."""
    if value is None:
        return
    stored = in_dtype(value, dtype)
    if math.isfinite(stored) and (stored != 0 or value == 0):
        return  # (the messages below cost more than the check)
    name = str(dtype).replace("torch.", "")
    _rule(
        math.isfinite(stored),
        key,
        value,
        f"is {stored} in {name}, the dtype of {why} (largest finite {torch.finfo(dtype).max:.4g})",
        fix,
    )
    _rule(
        stored != 0 or value == 0,
        key,
        value,
        f"rounds to 0 in {name}, the dtype of {why} (below its smallest positive number)",
        fix,
    )


def _timeout(key: str, value: float, fix: str) -> None:
    """A timeout in seconds: positive, and at most what thread joins and timedelta take."""
    _rule(
        0 < value <= MAX_TIMEOUT_S,
        key,
        value,
        f"must be a positive number of seconds, at most {MAX_TIMEOUT_S:.4g} (the longest "
        "timeout a thread join or a process group takes)",
        fix,
    )


def _no_effect(key: str, value, why: str, fix: str) -> str:
    """The one-line warning of a key whose valid value has no effect in this run."""
    return f"{key}={value!r} has no effect: {why}. Fix: {fix}."


def show_warnings(messages: list[str]) -> None:
    """Print each of `messages` as one `warning: ...` line on stderr, once per run: only on
    rank 0 (the RANK variable; unset outside torchrun), and not again in this process or the
    ones it starts once the same messages were shown (WARNED_ENV; the launcher shows them, its
    ranks do not)."""
    if not messages or os.environ.get("RANK", "0") != "0":
        return
    digest = hashlib.blake2b("\n".join(messages).encode(), digest_size=8).hexdigest()
    if os.environ.get(WARNED_ENV) == digest:
        return
    for message in messages:
        print(f"warning: {message}", file=sys.stderr, flush=True)
    os.environ[WARNED_ENV] = digest
