"""The package graph stays acyclic: read every module's imports (ast, no import) and check the layering.

A module-level import is one that runs when the module is imported (at the top, or in a top-level ``if`` /
``try``, but not under ``if TYPE_CHECKING``). Imports inside functions are read too, for the module-level
circles they would close when called.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def package_roots() -> dict[str, Path]:
    """Import name -> folder of every package in the repository: the core, the bench and each plugin."""
    roots = {"engine": REPO / "core" / "engine", "engine_bench": REPO / "bench" / "engine_bench"}
    for distribution in sorted((REPO / "plugins").iterdir()):
        for folder in distribution.iterdir():
            if (folder / "__init__.py").exists():
                roots[folder.name] = folder
    return roots


def module_files() -> dict[str, Path]:
    modules = {}
    for name, root in package_roots().items():
        for path in root.rglob("*.py"):
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def module_level_imports(tree: ast.Module):
    """The import statements that run when the module is imported."""

    def walk(nodes):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If):
                yield from walk(node.orelse if _is_type_checking(node.test) else node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from walk(node.body + node.orelse + node.finalbody)
                for handler in node.handlers:
                    yield from walk(handler.body)

    yield from walk(tree.body)


def imported_modules(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The repository modules an import statement loads (the deepest module named, for ``from x import y``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")
            if MODULES[module].name != "__init__.py":
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix for alias in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph(all_imports: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        nodes = (
            [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            if all_imports
            else module_level_imports(tree)
        )
        for node in nodes:
            graph[module].update(imported_modules(module, node))
    return graph


def package_of(module: str) -> str:
    """``engine.frontend.llm`` -> ``engine.frontend``; a top-level module of the core is a package of its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" and len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_graph(module_graph: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in module_graph.items():
        for target in targets:
            if package_of(module) != package_of(target):
                graph[package_of(module)].add(package_of(target))
    return graph


def edges_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    return [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]


def test_the_graph_reader_finds_a_cycle_and_the_packages():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert package_of("engine.frontend.llm") == "engine.frontend" and package_of("engine.config") == "engine.config"
    graph = import_graph(all_imports=False)
    assert "engine.messages" in graph["engine.scheduler.output"]  # it reads real imports
    assert "engine.frontend.llm" not in graph["engine"]  # the lazy public facade is not a module-level import


def test_no_import_cycle_between_packages():
    """Module-level imports: the packages form a DAG (a new circle fails here, with its edges)."""
    graph = package_graph(import_graph(all_imports=False))
    found = cycles(graph)
    assert found == [], [edges_within(graph, c) for c in found]


def test_no_import_cycle_between_modules_even_through_function_bodies():
    """No two modules import each other, not even lazily: an import inside a function is no way around a circle."""
    graph = import_graph(all_imports=True)
    found = cycles(graph)
    assert found == [], [edges_within(graph, c) for c in found]


# the contract module, the config, the request parameters (sampling, pooling, LoRA), the wire messages and the
# process-lifetime helpers
GROUND_FLOOR = {
    "engine.hookspecs",
    "engine.config",
    "engine.errors",
    "engine.sampling_params",
    "engine.pooling_params",
    "engine.messages",
    "engine.lora_request",
    "engine.lifetime",
}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if package_of(m) in GROUND_FLOOR))
def test_the_ground_floor_imports_only_the_ground_floor(module):
    graph = import_graph(all_imports=False)
    assert {package_of(t) for t in graph[module] if t.startswith("engine")} <= GROUND_FLOOR, graph[module]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if package_of(m) == "engine.interfaces"))
def test_the_contract_depends_only_on_config_sampling_params_and_messages(module):
    """``interfaces/`` (what plugins build on) imports, at module level, only itself and the ground floor."""
    graph = import_graph(all_imports=False)
    outside = {t for t in graph[module] if package_of(t) not in GROUND_FLOOR | {"engine.interfaces"}}
    assert outside == set(), outside


def test_the_engine_core_does_not_import_the_front_end_and_the_scheduler_not_the_worker():
    graph = package_graph(import_graph(all_imports=True))

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    assert not reaches("engine.engine_core", "engine.frontend")
    assert not reaches("engine.scheduler", "engine.worker")
    assert not reaches("engine.worker", "engine.engine_core")
    assert not any(reaches(f"engine.{p}", "engine_bench") for p in ("frontend", "engine_core", "entrypoints"))
