"""No import cycle inside our internal packages, counting imports under ``TYPE_CHECKING`` too.

A cycle that only type checking sees still ties the modules into one unit that
cannot be read, tested or changed alone; the classic FSDP package once had one
(comm hook, flat parameter, gradient buckets, parameter views, unit state).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DISTRIBUTED = Path(__file__).resolve().parents[2] / "src" / "tensorplay" / "distributed"
PACKAGES = ["_comm", "_checks", "_sharding", "fsdp/_classic", "fsdp/_fully_shard", "checkpoint"]


def sibling_imports(path: Path) -> set[str]:
    """The modules of ``path``'s own package that it imports (``from .x import``, ``from . import x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    root = DISTRIBUTED / package
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {p.stem: sibling_imports(p) & modules for p in root.glob("*.py") if p.stem != "__init__"}
    assert find_cycle(graph) is None, f"{package}: import cycle {' -> '.join(find_cycle(graph) or [])}"
