"""The build backend (pyproject.toml): scikit-build-core builds the wheel and the sdist; an editable install
(`pip install -e .`, which scripts/setup.sh runs) is a wheel of only the metadata, the console script and a `.pth`
line putting this checkout's root on sys.path, so its ringserve/ folder is the package every process imports.

A plain `.pth` rather than scikit-build-core's editable import hooks: those put their package ahead of the current
directory and PYTHONPATH, while a `.pth` entry comes after them, as for any installed package. The native parts are
not built here: scripts/build-native.sh builds them into ringserve/.
"""

from __future__ import annotations

import base64
import hashlib
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from scikit_build_core.build import (
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

CHECKOUT = Path(__file__).resolve().parent.parent


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    return []  # reading the metadata needs only scikit-build-core, a build-system requirement already


def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    return prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_editable(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        if metadata_directory is None:
            metadata_directory = str(Path(scratch) / prepare_metadata_for_build_wheel(scratch, config_settings))
        dist_info = Path(metadata_directory)
        name, version = dist_info.name.removesuffix(".dist-info").split("-")
        files = {
            f"{dist_info.name}/{path.relative_to(dist_info).as_posix()}": path.read_bytes()
            for path in sorted(dist_info.rglob("*"))
            if path.is_file() and path.name not in ("WHEEL", "RECORD")
        }
        # A .pth of a path only, no code: the root joins sys.path at start-up, after the current directory.
        files[f"_{name}_checkout.pth"] = f"{CHECKOUT}\n".encode()
        files[f"{dist_info.name}/WHEEL"] = (
            b"Wheel-Version: 1.0\nGenerator: ringserve checkout_backend\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        record = [_record_line(entry, data) for entry, data in files.items()] + [f"{dist_info.name}/RECORD,,"]
        files[f"{dist_info.name}/RECORD"] = ("\n".join(record) + "\n").encode()
        wheel_name = f"{name}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(Path(wheel_directory) / wheel_name, "w", zipfile.ZIP_DEFLATED) as wheel:
            for entry, data in files.items():
                wheel.writestr(entry, data)
    return wheel_name
