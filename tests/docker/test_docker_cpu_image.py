"""The built ringserve:cpu image itself: runs as a non-root user, carries no compiler and no pip cache, and a container
given too small a /dev/shm exits at once with a message saying which flag to use instead of failing mid-serving."""

from __future__ import annotations

import json

import pytest
from docker_harness import BUILD_TIMEOUT_S, docker

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 600)

COMPILERS = ("gcc", "g++", "cc", "c++", "cpp", "x86_64-linux-gnu-gcc-12", "clang", "cmake", "ninja")


def test_image_runs_as_non_root_without_compiler_or_pip_cache(cpu_image: str) -> None:
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", cpu_image).stdout)
    assert config["User"] == "10001:10001"
    assert docker("run", "--rm", cpu_image, "id", "-u").stdout.strip() == "10001"

    # as root, to see every home and cache folder; `command -v` finds a compiler anywhere on PATH
    probe = " ".join(f"command -v {c};" for c in COMPILERS)
    found = docker("run", "--rm", "--user", "0", cpu_image, "sh", "-c", f"{probe} true").stdout.split()
    assert found == [], f"build tools in the runtime image: {found}"
    caches = docker("run", "--rm", "--user", "0", cpu_image, "find", "/", "-xdev", "-type", "d", "(", "-path",
                    "*/.cache/pip", "-o", "-path", "*/.cache/uv", ")", "-print").stdout.split()  # fmt: skip
    assert caches == [], f"package caches in the runtime image: {caches}"


def test_too_small_shm_exits_with_a_clear_message(cpu_image: str) -> None:
    ran = docker("run", "--rm", "--shm-size=64m", cpu_image, timeout=120, check=False)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "/dev/shm holds 64 MiB" in ran.stderr and "--shm-size=1g" in ran.stderr, ran.stderr
