"""Names and sizes of the shared-memory ring segments (see docs/contracts.md)."""

from __future__ import annotations

import os
import secrets

# Ring data capacities in bytes (powers of two). A step plan for a full batch of long prompts is the largest record.
REQUEST_RING_BYTES = 1 << 24
EVENT_RING_BYTES = 1 << 24
STEP_RING_BYTES = 1 << 26
RESULT_RING_BYTES = 1 << 22


def new_segment_name(role: str) -> str:
    """An unpredictable segment name that records its creator, so stale segments can be reclaimed."""
    return f"/ringserve-{os.getpid()}-{secrets.token_hex(8)}-{role}"
