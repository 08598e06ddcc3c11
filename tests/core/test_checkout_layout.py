"""The checkout is the package: ringserve/ at the root links to the process folders, a source import resolves from a
bare clone, and an editable install points the environment at this folder through a plain path line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ringserve"


def test_the_package_folder_links_each_process_folder_by_a_relative_link():
    for name in ("frontend", "backend", "workers"):
        link = PACKAGE / name
        assert link.is_symlink(), f"ringserve/{name} should be a link to ../{name}"
        assert os.readlink(link) == f"../{name}"  # relative: it resolves in any clone, sdist or build context
        assert (link / "__init__.py").is_file()


def test_a_source_import_resolves_to_the_checkout_without_site_packages_or_a_build():
    # -S: no site-packages, so neither an installed ringserve nor an editable install's path line can answer.
    code = "import importlib.util as u; print(u.find_spec('ringserve.frontend.api.server').origin)"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert Path(out) == PACKAGE / "frontend" / "api" / "server.py"
    assert Path(out).resolve() == ROOT / "frontend" / "api" / "server.py"


@pytest.mark.skipif(importlib.util.find_spec("scikit_build_core") is None, reason="needs the build backend")
def test_an_editable_install_is_metadata_the_command_and_a_path_line_to_this_checkout(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("checkout_backend", ROOT / "scripts" / "checkout_backend.py")
    assert spec is not None and spec.loader is not None
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    monkeypatch.chdir(ROOT)  # a build backend runs in the source tree
    wheel_name = backend.build_editable(str(tmp_path))
    with zipfile.ZipFile(tmp_path / wheel_name) as wheel:
        names = set(wheel.namelist())
        path_lines = [name for name in names if name.endswith(".pth")]
        assert len(path_lines) == 1
        assert wheel.read(path_lines[0]).decode().splitlines() == [str(ROOT)]  # a path, no code to run at start-up
        dist_info = wheel_name.split("-py3")[0] + ".dist-info"
        assert "ringserve = ringserve.frontend.cli:main" in wheel.read(f"{dist_info}/entry_points.txt").decode()
        assert not [name for name in names if name.startswith("ringserve/")]  # the sources stay in the checkout
