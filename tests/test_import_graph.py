"""The layering the README's architecture section promises, read from the source (no imports run).

- No import cycles among server/, compat/ and engine/ modules, counting imports inside functions
  (an import deferred into a function still closes a cycle; only TYPE_CHECKING imports are free).
- No product module imports another module's private (underscore) name.
- Data flows one way: engine/ never imports server/ or compat/; compat/ never imports server/.
- The scheduler and the block pool import neither torch nor numpy, so their tests run over plain ints.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "compat", "engine")


@dataclass(frozen=True)
class ImportEdge:
    source: str  # importing module
    target: str  # imported module (the deepest of ours the import names)
    names: tuple[str, ...]  # names taken with `from target import ...`
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _walk_imports(child)


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(modules: dict[str, Path]) -> list[ImportEdge]:
    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = []
    for module, path in modules.items():
        for node in _walk_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(ours(alias.name), ()) for alias in node.names]
            else:
                base = _absolute(module, path, node)
                # `from pkg import mod` imports the submodule; `from mod import name` the module
                targets = [(ours(f"{base}.{alias.name}"), (alias.name,)) for alias in node.names]
            edges += [ImportEdge(module, target, names, node.lineno) for target, names in targets if target]
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def edges() -> list[ImportEdge]:
    return import_edges(product_modules())


def test_the_graph_is_read_from_every_package(edges):
    modules = product_modules()
    assert {m.split(".")[0] for m in modules} == set(PACKAGES)
    assert len(edges) > 100  # a broken walk (no edges) must not pass the checks below


def test_no_import_cycles_even_through_imports_inside_functions(edges):
    graph: dict[str, set[str]] = {m: set() for m in product_modules()}
    for edge in edges:
        if edge.target != edge.source and not edge.source.startswith(edge.target + "."):  # a package's own __init__
            graph[edge.source].add(edge.target)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names(edges):
    private = [
        f"{e.source}:{e.line} takes {name} from {e.target}"
        for e in edges
        for name in e.names
        if name.startswith("_") and not name.startswith("__") and e.target != e.source
    ]
    assert private == []


def test_data_flows_one_way(edges):
    upward = [
        f"{e.source}:{e.line} imports {e.target}"
        for e in edges
        if (e.source.startswith("engine") and e.target.split(".")[0] in ("server", "compat"))
        or (e.source.startswith("compat") and e.target.startswith("server"))
    ]
    assert upward == []


@pytest.mark.parametrize("module", ["engine.core.scheduler", "engine.core.kv_blocks", "engine.core.sequence"])
def test_scheduling_modules_are_plain_python(module):
    path = product_modules()[module]
    imported = {
        alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
        for node in _walk_imports(ast.parse(path.read_text()))
        for alias in node.names
    }
    assert not imported & {"torch", "numpy"}
