"""The engine process runs with huge-page malloc; the workers it starts get the operator's original setting back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ringserve.backend.engine_main import worker_env
from ringserve.backend.process import HUGE_PAGE_MALLOC, engine_environment, worker_environment


@pytest.mark.parametrize("original", [None, "glibc.malloc.arena_max=2"])
def test_engine_gets_huge_page_malloc_and_its_workers_the_original_tunables(original):
    base = {"PATH": "/usr/bin"} if original is None else {"PATH": "/usr/bin", "GLIBC_TUNABLES": original}
    engine = engine_environment(base)
    want = HUGE_PAGE_MALLOC if original is None else f"{original}:{HUGE_PAGE_MALLOC}"
    assert engine["GLIBC_TUNABLES"] == want and engine["PATH"] == "/usr/bin"
    assert base == ({"PATH": "/usr/bin"} if original is None else {"PATH": "/usr/bin", "GLIBC_TUNABLES": original})
    assert worker_environment(engine) == base  # the marker goes, the original comes back (or none)
    assert engine_environment(engine) == engine  # applying it twice changes nothing


def test_an_operators_own_setting_or_the_switch_wins():
    own = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert engine_environment(own) == own
    off = {"RINGSERVE_ENGINE_HUGE_PAGES": "0"}
    assert engine_environment(off) == off
    assert worker_environment(off) == off


def test_worker_env_of_the_engine_process_restores_the_tunables(monkeypatch):
    for key, value in engine_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}).items():
        monkeypatch.setenv(key, value)
    env = worker_env(29500)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2" and env["MASTER_PORT"] == "29500"
    assert not any(k.startswith("RINGSERVE_WORKER_GLIBC") for k in env)


def test_a_process_started_with_it_is_told_so_and_glibc_accepts_the_tunable():
    script = ("import json; from ringserve.backend.process import malloc_huge_pages_requested as m; "
              "print(json.dumps(m()))")  # fmt: skip
    env = engine_environment({k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is True
