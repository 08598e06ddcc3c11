"""The Docker tests' engine and images. `scripts/docker-env.sh up` finds the running engine or (root, Debian) installs
docker.io and starts dockerd; where neither is possible these tests skip with its reason, as the GPU tests do without
a GPU. `scripts/docker-env.sh build` builds ringserve:cpu (the build cache makes a rebuild of unchanged files quick),
and at the end of the session `down` stops the dockerd that `up` started. RINGSERVE_DOCKER_TESTS=0 skips them.
A cold build takes longer than pytest's default timeout: the test modules raise theirs (BUILD_TIMEOUT_S).
scripts/test.sh starts `up` and `build` in the background before the other tests; these tests then run last and
first wait for that (RINGSERVE_DOCKER_PREPARED names the file that receives its exit status)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker_harness import BUILD_TIMEOUT_S, ENV_SCRIPT

IMAGE = "ringserve:cpu"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Docker tests last in the session (this hook sees every collected test): the other tests run while
    scripts/test.sh gets the engine and the images ready in the background."""
    here = Path(__file__).parent
    items.sort(key=lambda item: item.path.is_relative_to(here))  # stable: the order within each part is kept


def wait_for_background_preparation() -> None:
    prepared = os.environ.get("RINGSERVE_DOCKER_PREPARED")
    if not prepared:
        return
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not Path(prepared).exists():  # its exit status does not matter: `up` and `build` below report failures
        assert time.monotonic() < deadline, f"scripts/test.sh's Docker preparation not done in {BUILD_TIMEOUT_S}s"
        time.sleep(2)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[None]:
    if os.environ.get("RINGSERVE_DOCKER_TESTS") == "0":
        pytest.skip("RINGSERVE_DOCKER_TESTS=0")
    wait_for_background_preparation()
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


@pytest.fixture(scope="session")
def phoenix_venv(docker_engine: None) -> Path:
    """The virtual environment with Arize Phoenix (`scripts/docker-env.sh phoenix`, which scripts/test.sh also starts in
    the background): made once per machine and kept in the cache folder."""
    made = subprocess.run([str(ENV_SCRIPT), "phoenix"], capture_output=True, text=True, timeout=1800)
    assert made.returncode == 0, f"scripts/docker-env.sh phoenix exited with {made.returncode}\n{made.stderr}"
    return Path(made.stdout.strip().splitlines()[-1])
