"""Command-line defaults that can come from RINGSERVE_* environment variables (the CLI's and the engine's flags)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

ENV_PREFIX = "RINGSERVE_"


def env_name(flag: str) -> str:
    """`--max-tokens` or `max_tokens` -> `RINGSERVE_MAX_TOKENS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def env_default(name: str, default: T, type: Callable[[str], T] = str) -> T:
    """The value of RINGSERVE_<NAME> converted with `type` (use `parse_bool` for flags), else `default`.

    `name` may be a flag (`--max-tokens`) or a bare name (`MAX_TOKENS`). A value that does not convert raises
    ValueError naming the variable, so a typo in the environment is reported instead of silently ignored.
    """
    variable = env_name(name)
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        return type(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {variable}={raw!r} is invalid: {exc}") from exc


def env_help(name: str) -> str:
    """A suffix for --help text naming the variable that sets the default."""
    return f"(env {env_name(name)})"
