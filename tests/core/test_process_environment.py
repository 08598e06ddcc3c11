"""The engine process runs with huge-page malloc; the workers it starts get the operator's original setting back, and
OpenMP told to sleep at once instead of spinning (unless the operator set its wait policy or spin count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ringserve.backend.engine_main import worker_env
from ringserve.backend.process import HUGE_PAGE_MALLOC, OPENMP_WAIT_ENV, engine_environment, worker_environment
from ringserve.backend.ray_executor import passed_environment


@pytest.mark.parametrize("original", [None, "glibc.malloc.arena_max=2"])
def test_engine_gets_huge_page_malloc_and_its_workers_the_original_tunables(original):
    base = {"PATH": "/usr/bin"} if original is None else {"PATH": "/usr/bin", "GLIBC_TUNABLES": original}
    engine = engine_environment(base)
    want = HUGE_PAGE_MALLOC if original is None else f"{original}:{HUGE_PAGE_MALLOC}"
    assert engine["GLIBC_TUNABLES"] == want and engine["PATH"] == "/usr/bin"
    assert base == ({"PATH": "/usr/bin"} if original is None else {"PATH": "/usr/bin", "GLIBC_TUNABLES": original})
    # the marker goes, the original comes back (or none)
    assert worker_environment(engine) == {**base, **OPENMP_WAIT_ENV}
    assert engine_environment(engine) == engine  # applying it twice changes nothing


def test_an_operators_own_setting_or_the_switch_wins():
    own = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert engine_environment(own) == own
    off = {"RINGSERVE_ENGINE_HUGE_PAGES": "0"}
    assert engine_environment(off) == off
    assert worker_environment(off) == {**off, **OPENMP_WAIT_ENV}


def test_worker_env_of_the_engine_process_restores_the_tunables(monkeypatch):
    for key, value in engine_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}).items():
        monkeypatch.setenv(key, value)
    env = worker_env(29500)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2" and env["MASTER_PORT"] == "29500"
    assert not any(k.startswith("RINGSERVE_WORKER_GLIBC") for k in env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_ranks_on_ray_nodes_get_the_openmp_setting_too():
    assert passed_environment(worker_environment({"PATH": "/usr/bin"})) == OPENMP_WAIT_ENV


@pytest.mark.parametrize("own", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}])
def test_an_operators_own_openmp_wait_setting_is_kept(own):
    assert worker_environment({"PATH": "/usr/bin", **own}) == {"PATH": "/usr/bin", **own}


def test_torchs_openmp_runtime_in_a_worker_environment_does_not_spin():
    """PyTorch's libgomp reads the setting when it is loaded (its default: 300,000 polls); OMP_DISPLAY_ENV makes it
    print what it took."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env = {**worker_environment(base), "OMP_DISPLAY_ENV": "VERBOSE"}
    script = "import torch; torch.ones(1 << 20).add_(1)"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert "GOMP_SPINCOUNT = '0'" in out.stdout + out.stderr


def test_a_process_started_with_it_is_told_so_and_glibc_accepts_the_tunable():
    script = ("import json; from ringserve.backend.process import malloc_huge_pages_requested as m; "
              "print(json.dumps(m()))")  # fmt: skip
    env = engine_environment({k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is True
