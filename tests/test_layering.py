"""Imports flow one way (DESIGN.md): the KV operators and the cost model know nothing of the
runtime, the engine or the cluster; the errors module imports nothing of aaflow; only `cluster/`
talks to Ray for the scheduler."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at top level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["operators", "costmodel"])
def test_operators_and_costmodel_import_no_runtime_engine_or_cluster(package):
    forbidden = ("aaflow.runtime", "aaflow.engine", "aaflow.planning", "aaflow.workflow", "cluster", "ray")
    for path in sorted((ROOT / package).glob("*.py")):
        bad = sorted(m for m in imported_modules(path) if m.split(".")[0] == "ray" or m.startswith(forbidden))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_errors_module_imports_nothing_of_aaflow():
    assert not [m for m in imported_modules(ROOT / "aaflow" / "errors.py") if m.startswith(("aaflow", "cluster"))]


def test_the_scheduler_side_of_the_runtime_never_imports_ray():
    for path in sorted((ROOT / "aaflow" / "runtime").glob("*.py")):
        assert "ray" not in {m.split(".")[0] for m in imported_modules(path)}, path.name
        assert ".remote(" not in path.read_text() and "ray.wait" not in path.read_text(), path.name
