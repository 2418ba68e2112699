"""The code's three layers import one way, at module top, with no circle (docs/architecture.md).

core (engines, scheduler, KV objects and operators, cost model and planner, errors) <- cluster (Ray
actors, deployment, transports, calibration and planning on a live cluster) <- front end (public API,
YAML workflow files, CLI, HTTP endpoint, benchmarks). A folder is one layer: its package docstring
says which ("Layer: core."), and every module in the folder belongs to it. Read from the source with
`ast`: nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "aaflow"
RANK = {"core": 0, "cluster": 1, "front end": 2}
OPTIONAL = {"vllm", "nixl", "ucxx", "uvicorn", "fastapi", "langgraph", "langchain_openai", "openai", "matplotlib"}
OPTIONAL_WRAPPERS = {"aaflow.serving.app", "aaflow.engines_vllm.connector"}  # modules that import one at top


def declared_layer(folder: Path) -> str | None:
    """The layer a package folder's docstring declares ("Layer: core."), or None."""
    init = folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
    found = re.search(r"\bLayer: (core|cluster|front end)\.", doc or "")
    return found.group(1) if found else None


FOLDERS = sorted(p.parent for p in PACKAGE.rglob("__init__.py"))
LAYER_OF_FOLDER = {folder: declared_layer(folder) for folder in FOLDERS}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def layer(module: str) -> str:
    """The layer of a module of this repository: the one its folder declares."""
    return LAYER_OF_FOLDER[MODULES[module].parent]


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
            while target not in MODULES and "." in target and target.split(".")[0] == "aaflow":
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


def test_every_folder_declares_one_layer():
    undeclared = [str(folder.relative_to(REPO)) for folder, declared in LAYER_OF_FOLDER.items() if declared is None]
    assert not undeclared, f"package folders whose docstring says no 'Layer: core|cluster|front end.': {undeclared}"
    assert not [p for p in PACKAGE.rglob("*.py") if p.parent not in LAYER_OF_FOLDER], "a module outside any package"


@pytest.mark.parametrize("package", ["aaflow.operators", "aaflow.costmodel"])
def test_operators_and_cost_model_know_nothing_of_ray_clusters_the_runtime_or_an_engine(package):
    forbidden = ("aaflow.runtime", "aaflow.engine", "aaflow.planner", "aaflow.workflow")
    wrong = [f"{name}: {target}" for name, path in MODULES.items() if name == package or name.startswith(package + ".")
             for _, target, _ in imports(name, path)
             if target.split(".")[0] == "ray" or target.startswith(forbidden)
             or (target in MODULES and layer(target) != "core")]
    assert not wrong, wrong


def test_the_shared_modules_import_nothing_else_of_aaflow():
    for name, path in MODULES.items():
        if name.startswith("aaflow.common."):
            assert not [t for _, t, _ in imports(name, path) if t in MODULES and not t.startswith("aaflow.common")], name


def test_the_planners_pure_part_loads_no_ray_and_no_cluster_layer():
    """`aaflow.planner` (search, simulation, plans) imports, all the way down, neither Ray nor a module
    of the cluster layer: it can be used, and tested, without a cluster."""
    seen, todo = set(), [m for m in MODULES if m.startswith("aaflow.planner")]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(GRAPH[name])
    assert not [m for m in seen if layer(m) != "core"]
    assert not [m for m in seen for _, t, top in imports(m, MODULES[m]) if top and t.split(".")[0] == "ray"]


def test_the_scheduler_side_of_the_runtime_never_talks_to_ray():
    for name, path in MODULES.items():
        if name.startswith("aaflow.runtime"):
            assert "ray" not in {t.split(".")[0] for _, t, _ in imports(name, path)}, name
            assert ".remote(" not in path.read_text() and "ray.wait" not in path.read_text(), name


def test_function_level_imports_only_for_optional_dependencies_and_say_so():
    """The product's modules import at top. The benchmarks (`aaflow bench`) are left out: their modules
    are also run by path in vLLM's own environment and in client subprocesses, where only part of
    what a bench imports can load, so they import where used."""
    wrong = []
    for name, path in MODULES.items():
        if name.startswith("aaflow.benchmarks"):
            continue
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
    assert "aaflow.runtime.scheduler" in GRAPH["aaflow.planner.simulate"]
    assert layer("aaflow.cluster.scheduler_actor") == "cluster" and layer("aaflow.running") == "front end"
    assert layer("aaflow.workflow.graph") == "core" and layer("aaflow.workflow_files") == "front end"
    assert any(not top for name, path in MODULES.items() for _, _, top in imports(name, path))
