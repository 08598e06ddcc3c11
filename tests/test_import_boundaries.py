"""The folders are the processes: frontend/ (the gRPC process) and workers/ (the worker processes) never import each
other, backend/ (the engine process) imports neither and workers/ do not import it (the frontend starts engines through
backend/engine_process.py), ringserve/formats/ (what several processes share) imports none of them, and no module
imports itself back through others. Read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it is installed as.
PACKAGES = {"frontend": "ringserve.frontend", "backend": "ringserve.backend", "workers": "ringserve.workers",
            "ringserve/formats": "ringserve.formats"}  # fmt: skip
FORBIDDEN = {
    "ringserve.frontend": ("ringserve.workers",),
    "ringserve.workers": ("ringserve.frontend", "ringserve.backend"),
    "ringserve.backend": ("ringserve.frontend", "ringserve.workers"),
    "ringserve.formats": ("ringserve.frontend", "ringserve.backend", "ringserve.workers"),
}
# Import circles allowed; none are, and this list only shrinks.
EXPECTED_CYCLES: list[set[str]] = []


def source_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module or `module.name`, line) for every import, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base, node.lineno
            yield from ((f"{base}.{alias.name}", node.lineno) for alias in node.names)


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """The graph between source modules and the forbidden imports found (as `file:line: what`)."""
    modules = source_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    violations = []
    for module, path in modules.items():
        for name, line in imported_names(module, path):
            owner = next((p for p in FORBIDDEN if module == p or module.startswith(p + ".")), None)
            if owner and any(name == f or name.startswith(f + ".") for f in FORBIDDEN[owner]):
                violations.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
            if name in modules and name != module and not module.startswith(name + "."):
                graph[module].add(name)  # a package's __init__ that a submodule imports is no circle
    return graph, violations


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_checks() -> None:
    graph, _ = import_graph()
    assert "ringserve.formats.engine_args" in graph["ringserve.backend.engine_main"]
    assert "ringserve.formats.spec_tree" in graph["ringserve.workers.speculative.tree"]


def test_no_process_folder_imports_one_it_must_not() -> None:
    _, violations = import_graph()
    assert violations == []


def test_no_module_imports_itself_back_through_others() -> None:
    graph, _ = import_graph()
    found = cycles(graph)
    unexpected = [sorted(c) for c in found if c not in EXPECTED_CYCLES]
    assert unexpected == [], "new import circles"
    gone = [sorted(c) for c in EXPECTED_CYCLES if c not in found]
    if gone:
        pytest.fail(f"these circles are broken: remove them from EXPECTED_CYCLES: {gone}")


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []
