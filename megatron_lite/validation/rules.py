"""The two checks every validation rule is written with: a predicate and an enumerated choice."""

from __future__ import annotations

from megatron_lite.config import ConfigError


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
