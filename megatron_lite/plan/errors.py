"""The planner's one error form for a bad flag (its own module: plan/flags.py and the modules
that check flags against the run, e.g. plan/dry_run.py, both raise it)."""

from __future__ import annotations

from megatron_lite.config import ConfigError


def _shown(text: str) -> str:
    return text if text and text.strip() == text else repr(text)


def flag_error(flag: str, text, rule: str, fix: str):
    """ConfigError "flag=value: rule. Fix: fix" (a switch, value None: "flag: rule. ...")."""
    shown = "" if text is None else f"={_shown(str(text))}"
    raise ConfigError(f"{flag}{shown}: {rule}. Fix: {fix}")
