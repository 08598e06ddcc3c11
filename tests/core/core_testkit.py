"""Helpers shared by the ringserve._core tests (a module of its own: `conftest` names clash across test folders)."""

from __future__ import annotations

import os
import secrets


def segment_name(role: str) -> str:
    """A name in the production pattern, owned by this (live) process."""
    return f"/ringserve-{os.getpid()}-{secrets.token_hex(8)}-{role}"
