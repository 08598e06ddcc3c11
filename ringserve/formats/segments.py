"""Names and sizes of the shared-memory ring segments, and the KV peer-info folders (see docs/contracts.md)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

# Ring data capacities in bytes (powers of two). A step plan for a full batch of long prompts is the largest record.
REQUEST_RING_BYTES = 1 << 24
EVENT_RING_BYTES = 1 << 24
STEP_RING_BYTES = 1 << 26
RESULT_RING_BYTES = 1 << 22


def new_segment_name(role: str) -> str:
    """An unpredictable segment name that records its creator, so stale segments can be reclaimed."""
    return f"/ringserve-{os.getpid()}-{secrets.token_hex(8)}-{role}"


# The folder where a disaggregated server's workers publish their KV peer infos (rank<r>.bin). Its name carries the
# creating frontend's pid, like a segment's, so a folder whose creator died can be recognised and removed.
KV_INFO_DIR_PREFIX = "ringserve-kv-"


def new_kv_info_dir() -> str:
    return tempfile.mkdtemp(prefix=f"{KV_INFO_DIR_PREFIX}{os.getpid()}-")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def reclaim_stale_kv_info_dirs(root: str | None = None) -> list[str]:
    """Remove the KV peer-info folders under `root` (the temp folder) whose creating process is gone."""
    root = root or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(root):
        if not entry.name.startswith(KV_INFO_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid_text = entry.name[len(KV_INFO_DIR_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not process_alive(int(pid_text)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed
