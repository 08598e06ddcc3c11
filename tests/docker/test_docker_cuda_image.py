"""docker/Dockerfile.cuda built on this machine (no GPU needed) by `scripts/docker-env.sh build-cuda`, which also checks
inside the image that `ringserve serve --help` runs and that torch, ringserve._core and NCCL's library load. Not part of
every run: torch's CUDA wheels are several GB. RINGSERVE_DOCKER_CUDA=1 runs it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from docker_harness import BUILD_TIMEOUT_S, ENV_SCRIPT, docker

pytestmark = [
    pytest.mark.skipif(os.environ.get("RINGSERVE_DOCKER_CUDA") != "1",
                       reason="the CUDA image downloads several GB of CUDA wheels: RINGSERVE_DOCKER_CUDA=1 builds it"),
    pytest.mark.timeout(BUILD_TIMEOUT_S),
]  # fmt: skip


def test_cuda_image_builds_and_loads_torch_core_and_nccl(docker_engine: None) -> None:
    built = subprocess.run([str(ENV_SCRIPT), "build-cuda"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert built.returncode == 0, f"scripts/docker-env.sh build-cuda exited with {built.returncode}\n{built.stdout}\n" \
        f"{built.stderr}"  # fmt: skip
    assert "NCCL " in built.stdout and "torch 2.13.0" in built.stdout, built.stdout

    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", "ringserve:cuda").stdout)
    assert config["User"] == "10001:10001"
    assert {"50051/tcp", "8000/tcp", "8002/tcp"} <= config["ExposedPorts"].keys(), config["ExposedPorts"]
    found = docker("run", "--rm", "--user", "0", "ringserve:cuda", "sh", "-c",
                   "command -v gcc g++ cc c++ cmake ninja; true").stdout.split()  # fmt: skip
    assert found == [], f"build tools in the runtime image: {found}"
