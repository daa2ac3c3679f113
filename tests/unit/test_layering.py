"""The product's layers import downwards only, and no module imports itself in a circle.

trainflow's root modules (errors, config_base) are what every layer uses, so they import
nothing from the layers; cluster/ (where work runs) knows nothing of tasks/ (the stage work);
only flows/ imports flows/; inside tasks/ imports follow the data path (preprocess -> train ->
evaluate, a search above train) and the shared leaves (objectives, tracking, the modules at
tasks/'s top) import no stage; and among flows/, tasks/, cluster/ and the root modules no
import chain leads back to where it started. Imports are read from the source (ast), at the top of a
module, inside functions and under TYPE_CHECKING alike: a deferred import still ties two
modules together.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"flows": "trainflow.flows", "tasks": "trainflow.tasks", "cluster": "trainflow.cluster"}

TASK_LEVELS = {
    "objectives": 1,
    "tracking": 1,
    "preprocess": 2,
    "train": 3,
    "evaluate": 4,
    "search": 4,
}
"""Where each package of tasks/ sits on the data path; the modules at tasks/'s top are level 0.
A module imports only from lower levels or its own package: objectives and tracking are
shared leaves (the stages use them, they use no stage), and a stage uses only earlier ones."""

Graph = dict[str, dict[str, int]]
"""Module -> {module it imports: line of the first such import}."""


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the product by its installed name (trainflow.tasks.train.loop, ...)."""
    found = {}
    for folder, package in LAYERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    for path in sorted((root / "trainflow").glob("*.py")):  # the links to the layers: not files
        found["trainflow" if path.stem == "__init__" else f"trainflow.{path.stem}"] = path
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or the nearest package above it, among the product's modules."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, path: Path, modules: dict[str, Path]
) -> Iterator[str | None]:
    if isinstance(node, ast.Import):
        yield from (_known(alias.name, modules) for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    for alias in node.names:  # `from pkg import sub` imports the module pkg.sub
        sub = f"{base}.{alias.name}"
        yield sub if sub in modules else _known(base, modules)


def import_graph(root: Path = ROOT) -> Graph:
    """Which product module imports which, wherever in the module the import is."""
    modules = product_modules(root)
    graph: Graph = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, module, path, modules):
                    if target is not None and target != module:
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(graph.get(nxt, {}))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _where(graph: Graph, module: str, target: str) -> str:
    return f"{module} -> {target} (line {graph[module][target]})"


def _task_place(module: str) -> tuple[str, int] | None:
    """(package, level) of a tasks/ module; None outside tasks/."""
    parts = module.split(".")
    if parts[:2] != ["trainflow", "tasks"]:
        return None
    package = parts[2] if len(parts) > 2 and parts[2] in TASK_LEVELS else ""
    return package, TASK_LEVELS.get(package, 0)


def against_the_data_path(graph: Graph) -> list[str]:
    """The imports inside tasks/ that go up or sideways between its packages."""
    found = []
    for module, edges in graph.items():
        here = _task_place(module)
        for target in edges:
            there = _task_place(target)
            if here and there and here[0] != there[0] and there[1] >= here[1]:
                found.append(_where(graph, module, target))
    return found


def test_tasks_import_along_the_data_path_only() -> None:
    arrows = against_the_data_path(import_graph())
    assert not arrows, "tasks/ imports against the data path:\n" + "\n".join(arrows)


def test_the_data_path_check_finds_the_arrows_that_went_back_up() -> None:
    """The three arrows issue 46 removed, and a top module reaching a stage, each fail."""
    graph: Graph = {
        "trainflow.tasks.objectives.classification": {"trainflow.tasks.evaluate.plots": 67},
        "trainflow.tasks.tracking.progress": {"trainflow.tasks.train.checkpointing.checkpoint": 20},
        "trainflow.tasks.tracking.stage_logs": {"trainflow.tasks.preprocess.ref": 6},
        "trainflow.tasks.tracking.lineage": {"trainflow.tasks.objectives": 3},
        "trainflow.tasks.hashing": {"trainflow.tasks.preprocess.dataset": 9},
        "trainflow.tasks.evaluate.run": {"trainflow.tasks.search.study": 4},
        "trainflow.tasks.train.job": {
            "trainflow.tasks.preprocess.ref": 1,
            "trainflow.tasks.tracking.journal": 2,
            "trainflow.tasks.objectives": 3,
            "trainflow.tasks.spec": 4,
            "trainflow.tasks.train.loop": 5,
            "trainflow.cluster.config": 6,
        },
    }
    assert against_the_data_path(graph) == [
        "trainflow.tasks.objectives.classification -> trainflow.tasks.evaluate.plots (line 67)",
        "trainflow.tasks.tracking.progress -> "
        "trainflow.tasks.train.checkpointing.checkpoint (line 20)",
        "trainflow.tasks.tracking.stage_logs -> trainflow.tasks.preprocess.ref (line 6)",
        "trainflow.tasks.tracking.lineage -> trainflow.tasks.objectives (line 3)",
        "trainflow.tasks.hashing -> trainflow.tasks.preprocess.dataset (line 9)",
        "trainflow.tasks.evaluate.run -> trainflow.tasks.search.study (line 4)",
    ]


def test_cluster_imports_nothing_from_tasks() -> None:
    graph = import_graph()
    climbing = [
        _where(graph, module, target)
        for module, edges in graph.items()
        if module.startswith("trainflow.cluster")
        for target in edges
        if target.startswith("trainflow.tasks")
    ]
    assert not climbing, "cluster/ imports from tasks/:\n" + "\n".join(climbing)


def test_only_flows_import_flows() -> None:
    graph = import_graph()
    climbing = [
        _where(graph, module, target)
        for module, edges in graph.items()
        if not module.startswith("trainflow.flows")
        for target in edges
        if target.startswith("trainflow.flows")
    ]
    assert not climbing, "tasks/, cluster/ or the root import flows/:\n" + "\n".join(climbing)


def test_the_package_root_imports_no_layer() -> None:
    graph = import_graph()
    layers = tuple(LAYERS.values())
    root_modules = [m for m in graph if m.count(".") <= 1 and not m.startswith(layers)]
    assert {"trainflow", "trainflow.errors", "trainflow.config_base"} <= set(root_modules)
    climbing = [
        _where(graph, module, target)
        for module in root_modules
        for target in graph[module]
        if target.startswith(layers)
    ]
    assert not climbing, "trainflow's root modules import a layer:\n" + "\n".join(climbing)


def test_no_import_cycle_among_the_product_modules() -> None:
    graph = import_graph()
    found = cycles(graph)
    report = [
        "; ".join(_where(graph, m, t) for m in component for t in graph[m] if t in component)
        for component in found
    ]
    assert not found, "import cycles:\n" + "\n".join(report)


def test_the_graph_sees_deferred_relative_and_type_only_imports(tmp_path: Path) -> None:
    """The checks above can fail: the reader finds each kind of import, and the cycle finder
    finds a circle closed by a deferred import."""
    for folder in LAYERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "trainflow").mkdir()
    (tmp_path / "trainflow" / "__init__.py").write_text("")
    (tmp_path / "trainflow" / "errors.py").write_text("import trainflow.tasks.a\n")
    (tmp_path / "tasks" / "a.py").write_text("from . import b\n")
    (tmp_path / "tasks" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainflow.cluster import c\n"
    )
    (tmp_path / "cluster" / "c.py").write_text("def f():\n    from trainflow.tasks.a import x\n")
    graph = import_graph(tmp_path)
    assert graph["trainflow.errors"] == {"trainflow.tasks.a": 1}
    assert graph["trainflow.tasks.a"] == {"trainflow.tasks.b": 1}
    assert graph["trainflow.tasks.b"] == {"trainflow.cluster.c": 3}
    assert graph["trainflow.cluster.c"] == {"trainflow.tasks.a": 2}
    assert cycles(graph) == [["trainflow.cluster.c", "trainflow.tasks.a", "trainflow.tasks.b"]]
    assert cycles({"x": {"y": 1}, "y": {}}) == []
