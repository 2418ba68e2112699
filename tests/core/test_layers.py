"""The code's three layers import one way, at module top, with no circle (docs/architecture.md).

core (engines, scheduler, KV objects and operators, cost model, errors) <- cluster (Ray actors,
deployment, transports, calibration and planning on a live cluster) <- front end (public API,
DSL's YAML, CLI, HTTP endpoint). Read from the source with `ast`: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("aaflow", "cluster", "operators", "costmodel")
FRONT_END = ("aaflow.api", "aaflow.running", "aaflow.workflow", "aaflow.cli", "aaflow.cli_deploy", "aaflow.cli_options",
             "aaflow.cli_planning", "aaflow.serving", "aaflow.submission", "aaflow.demo", "aaflow.integrations")
CLUSTER = ("cluster", "aaflow.planning", "aaflow.calibration", "aaflow.calibration_cores")
RANK = {"core": 0, "cluster": 1, "front end": 2}
OPTIONAL = {"vllm", "nixl", "ucxx", "uvicorn", "fastapi", "langgraph", "langchain_openai", "openai", "matplotlib"}
OPTIONAL_WRAPPERS = {"aaflow.serving.app", "aaflow.engines_vllm.connector"}  # modules that import one at top


def layer(module: str) -> str:
    """The layer of a module of this repository: `aaflow` itself (the facade) is front end, the
    workflow graph the core runs (and the checks of its nodes) is core, the rest by the prefixes above."""
    def under(prefixes):
        return any(module == p or module.startswith(p + ".") for p in prefixes)
    if module in ("aaflow.workflow.graph", "aaflow.workflow.checks"):
        return "core"
    if module == "aaflow" or under(FRONT_END):
        return "front end"
    return "cluster" if under(CLUSTER) else "core"


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def imports(name: str, path: Path) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, imported first-party module or outside top-level name, at module top) per import,
    leaving out those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {id(n) for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    top = {id(n) for node in tree.body for n in (ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node])}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            while target not in MODULES and "." in target and target.split(".")[0] in PACKAGES:
                target = target.rpartition(".")[0]
            found.append((node, target, id(node) in top))
    return found


GRAPH = {name: {t for _, t, _ in imports(name, path) if t in MODULES and t != name} for name, path in MODULES.items()}


def test_no_import_circle():
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                circles.append(sorted(group))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not circles, f"modules that import each other (directly or around a circle): {circles}"


def test_imports_point_down_the_layers():
    upward = [f"{name} ({layer(name)}) imports {target} ({layer(target)})"
              for name, targets in GRAPH.items() for target in sorted(targets)
              if RANK[layer(target)] > RANK[layer(name)]]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("package", ["operators", "costmodel"])
def test_operators_and_cost_model_know_nothing_of_ray_clusters_the_runtime_or_an_engine(package):
    forbidden = ("aaflow.runtime", "aaflow.engine", "aaflow.planning", "aaflow.workflow")
    wrong = [f"{name}: {target}" for name, path in MODULES.items() if name.split(".")[0] == package
             for _, target, _ in imports(name, path)
             if target.split(".")[0] == "ray" or target.startswith(forbidden)
             or (target in MODULES and layer(target) != "core")]
    assert not wrong, wrong


def test_the_errors_module_imports_nothing_of_aaflow():
    assert not [t for _, t, _ in imports("aaflow.errors", MODULES["aaflow.errors"]) if t.split(".")[0] in PACKAGES]


def test_the_scheduler_side_of_the_runtime_never_talks_to_ray():
    for name, path in MODULES.items():
        if name.startswith("aaflow.runtime"):
            assert "ray" not in {t.split(".")[0] for _, t, _ in imports(name, path)}, name
            assert ".remote(" not in path.read_text() and "ray.wait" not in path.read_text(), name


def test_function_level_imports_only_for_optional_dependencies_and_say_so():
    wrong = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node, target, at_top in imports(name, path):
            if at_top:
                continue
            optional = target.split(".")[0] in OPTIONAL or target in OPTIONAL_WRAPPERS
            said = any("# optional" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)) or any(
                "# optional" in lines[i] for i in range(max(0, node.lineno - 4), node.lineno - 1))
            if not (optional and said):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {target}"
                             + ("" if optional else " (not an optional dependency)") + ("" if said else " (no '# optional' comment)"))
    assert not wrong, "function-level imports:\n" + "\n".join(wrong)


def test_the_checks_see_a_circle_and_an_upward_import():
    """The reading above is not vacuous: it finds the package's own imports of each other."""
    assert "aaflow.runtime.scheduler" in GRAPH["aaflow.planning.simulate"]
    assert layer("cluster.scheduler_actor") == "cluster" and layer("aaflow.running") == "front end"
    assert layer("aaflow.workflow.graph") == "core" and layer("aaflow.workflow.yaml_io") == "front end"
    assert any(not top for name, path in MODULES.items() for _, _, top in imports(name, path))
