"""The modules under src/tensorplay import each other without cycles (outside ``if TYPE_CHECKING:``).

The graph is read from the source with ``ast``: an edge A -> B for each import
statement that runs when A is imported (module level, class bodies, ``try`` and
plain ``if`` blocks), none for imports inside functions or under
``if TYPE_CHECKING:``. ``from P import n`` points at the module ``P.n`` when
there is one, else at ``P``; ``import a.b`` at the deepest module of ours it names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

#: Cycles known today, each listed as its sorted modules, to be removed (then deleted from here). None now:
#: the classic wrapper's helpers import it only under ``TYPE_CHECKING`` or inside functions.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root`` by dotted name (a package by its ``__init__.py``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _runs_on_import(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body`` that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _runs_on_import(node.body)
            yield from _runs_on_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _runs_on_import(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _runs_on_import(node.body)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that importing ``name`` imports directly."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runs_on_import(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        found.update(t for t in map(lambda target: _deepest(target, modules), targets) if t and t != name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as its sorted modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_src_has_no_import_cycle():
    graph = import_graph(SRC)
    classic = "tensorplay.distributed.fsdp._classic."
    assert classic + "runtime" in graph[classic + "fully_sharded_data_parallel"]  # the walk found the imports
    assert set(cycles(graph)) <= KNOWN_CYCLES, "import cycles (see the module docstring): " + "; ".join(
        " <-> ".join(c) for c in cycles(graph) if c not in KNOWN_CYCLES)


def test_known_cycles_still_exist():
    """A listed cycle that is gone must be deleted from ``KNOWN_CYCLES``."""
    assert KNOWN_CYCLES <= set(cycles(import_graph(SRC)))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_cycle_is_found_and_deferred_imports_are_not(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import thing\n",
        "pkg/b.py": "import pkg.c as c\nthing = 1\n",
        "pkg/c.py": "from pkg import a\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        "pkg/e.py": "def f():\n    from pkg import d\n\nclass K:\n    from . import f as g\n",
        "pkg/f.py": "try:\n    from .e import K\nexcept ImportError:\n    pass\n",
    })
    graph = import_graph(tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set() and graph["pkg.e"] == {"pkg.f"} and graph["pkg.f"] == {"pkg.e"}
    assert sorted(cycles(graph)) == [("pkg.a", "pkg.b", "pkg.c"), ("pkg.e", "pkg.f")]
