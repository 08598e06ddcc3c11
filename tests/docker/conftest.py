"""The Docker tests' engine and images. `scripts/docker-env.sh up` finds the running engine or (root, Debian) installs
docker.io and starts dockerd; where neither is possible these tests skip with its reason, as the GPU tests do without
a GPU. `scripts/docker-env.sh build` builds ringserve:cpu (the build cache makes a rebuild of unchanged files quick),
and at the end of the session `down` stops the dockerd that `up` started. RINGSERVE_DOCKER_TESTS=0 skips them.
A cold build takes longer than pytest's default timeout: the test modules raise theirs (BUILD_TIMEOUT_S)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
from docker_harness import BUILD_TIMEOUT_S, REPO

ENV_SCRIPT = REPO / "scripts" / "docker-env.sh"
IMAGE = "ringserve:cpu"


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[None]:
    if os.environ.get("RINGSERVE_DOCKER_TESTS") == "0":
        pytest.skip("RINGSERVE_DOCKER_TESTS=0")
    up = subprocess.run([str(ENV_SCRIPT), "up"], capture_output=True, text=True, timeout=1200)
    if up.returncode == 3:
        pytest.skip(up.stderr.strip().splitlines()[-1])
    assert up.returncode == 0, f"scripts/docker-env.sh up exited with {up.returncode}\n{up.stdout}\n{up.stderr}"
    yield
    if "starting dockerd" in up.stdout:  # an engine that was running before stays running
        subprocess.run([str(ENV_SCRIPT), "down"], capture_output=True, timeout=300)


@pytest.fixture(scope="session")
def cpu_image(docker_engine: None) -> str:
    """ringserve:cpu built from this checkout's docker/Dockerfile.cpu (plus the stand-in images the compose tests
    need where the official ones cannot be pulled)."""
    build = subprocess.run([str(ENV_SCRIPT), "build"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert build.returncode == 0, f"scripts/docker-env.sh build exited with {build.returncode}\n{build.stdout}\n" \
        f"{build.stderr}"  # fmt: skip
    return IMAGE
