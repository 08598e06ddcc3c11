"""Segment and folder names carry their creator's pid, so what a dead process left can be told from a live one's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ringserve.formats.segments import KV_INFO_DIR_PREFIX, new_kv_info_dir, process_alive, reclaim_stale_kv_info_dirs


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_new_kv_info_dir_is_private_and_names_this_process() -> None:
    path = Path(new_kv_info_dir())
    try:
        assert path.name.startswith(f"{KV_INFO_DIR_PREFIX}{os.getpid()}-")
        assert path.stat().st_mode & 0o777 == 0o700
    finally:
        path.rmdir()


def test_only_folders_of_dead_processes_are_reclaimed(tmp_path: Path) -> None:
    pid = dead_pid()
    assert not process_alive(pid) and process_alive(os.getpid())
    stale = tmp_path / f"{KV_INFO_DIR_PREFIX}{pid}-abc"
    live = tmp_path / f"{KV_INFO_DIR_PREFIX}{os.getpid()}-def"
    unrelated = tmp_path / f"{KV_INFO_DIR_PREFIX}notapid-x"
    other = tmp_path / f"other-{pid}-x"
    for folder in (stale, live, unrelated, other):
        folder.mkdir()
    (stale / "rank0.bin").write_bytes(b"info")
    as_file = tmp_path / f"{KV_INFO_DIR_PREFIX}{pid}-file"
    as_file.write_text("a file, not a folder")
    assert reclaim_stale_kv_info_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and unrelated.exists() and other.exists() and as_file.exists()
