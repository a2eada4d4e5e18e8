"""The import rules of src/tensorplay, read from the source with ``ast`` (each rule is shown able to fail).

1. No import cycle between modules (imports that run when a module is imported: module level, class bodies,
   ``try`` and plain ``if`` blocks; none inside functions or under ``if TYPE_CHECKING:``).
2. No import cycle between the modules of one internal package, counting ``TYPE_CHECKING`` imports too: a
   cycle that only type checking sees still ties the modules into one unit that cannot be read alone.
3. Only ``tensorplay.distributed._comm`` calls a c10d collective: every collective of ours goes through it
   (watched, bounded by the group's timeout).
4. No friend imports: a private module or name (``_x``) is imported only from inside the package that holds
   it (``P._x`` from ``P``'s subtree); what another package needs it exposes through a public module.
   The test harness shipped in src (``tensorplay.testing``) is exempt, as the tests are.
5. The sharding front ends (``fsdp``) never import the optimizers (``optim``), not even inside a function: in
   PyTorch neither FSDP needs them. Optimizers in backward register on the "gradient ready" hook point.

For rules 1 and 4 the graph's edges are resolved like this: ``from P import n`` points at the module ``P.n``
when there is one, else at ``P``; ``import a.b`` at the deepest module of ours it names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
DISTRIBUTED = SRC / "tensorplay" / "distributed"
PACKAGES = ["_comm", "_checks", "_sharding", "fsdp/_classic", "fsdp/_fully_shard", "checkpoint"]
COMM = "tensorplay.distributed._comm"

#: The c10d collectives, as functions of ``torch.distributed`` (or our facade of it).
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_coalesced", "all_gather_object", "all_to_all", "all_to_all_single", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "gather",
    "gather_object", "scatter", "scatter_object_list",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list", "_all_gather_base", "_reduce_scatter_base",
})
#: Collectives as methods of a ``ProcessGroup`` (names no other object of ours uses).
GROUP_METHODS = frozenset({
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "alltoall", "alltoall_base", "_allgather_base", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
})
C10D_MODULES = frozenset({"torch.distributed", "torch.distributed.distributed_c10d", "tensorplay.distributed"})

#: The test harness shipped in src (``tensorplay.testing``) reads the library's private state by design, as the
#: tests do (the scale simulation counts the watch's store use and lends ZeRO-style buffers): rule 4 covers the
#: library's own packages only.
HARNESS = "tensorplay.testing"


# ---- reading the source ---------------------------------------------------------------------------------
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


def _every_import(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def _origin(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module ``node`` (in module ``name`` at ``path``) imports from."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The dotted names ``node`` imports: modules, or ``module.attribute`` for names from a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    origin = _origin(name, path, node)
    return [f"{origin}.{alias.name}" for alias in node.names]


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that importing ``name`` imports directly."""
    found: set[str] = set()
    for node in _runs_on_import(ast.parse(path.read_text(), str(path)).body):
        for target in _targets(name, path, node, modules):
            module = _deepest(target, modules)
            if module and module != name:
                found.add(module)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


# ---- rule 1 and 2: cycles -------------------------------------------------------------------------------
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


def sibling_imports(path: Path) -> set[str]:
    """The modules of ``path``'s own package that it imports (``from .x import``, ``from . import x``), counting
    imports anywhere in the file (under ``TYPE_CHECKING`` too)."""
    found: set[str] = set()
    for node in _every_import(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def package_graph(root: Path) -> dict[str, set[str]]:
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    return {p.stem: sibling_imports(p) & modules for p in root.glob("*.py") if p.stem != "__init__"}


# ---- rule 3: collectives only in _comm ------------------------------------------------------------------
def _c10d_aliases(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """Local names bound to a c10d module (name -> module) and names bound to a c10d collective function."""
    modules: dict[str, str] = {"torch": "torch", "tensorplay": "tensorplay"}
    functions: set[str] = set()
    for node in _every_import(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
        elif node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in C10D_MODULES:
                    modules[alias.asname or alias.name] = full
                if node.module in C10D_MODULES and alias.name in COLLECTIVES:
                    functions.add(alias.asname or alias.name)
    return modules, functions


def _dotted(node: ast.expr, modules: dict[str, str]) -> str | None:
    """``node`` (``a.b.c``) as a dotted name with its first name resolved through ``modules``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in modules:
        return None
    return ".".join([modules[node.id], *reversed(parts)])


def c10d_calls(source: str) -> list[tuple[int, str]]:
    """The c10d collectives ``source`` calls, as (line, what is called)."""
    tree = ast.parse(source)
    modules, functions = _c10d_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in functions:
            found.append((node.lineno, func.id))
        elif isinstance(func, ast.Attribute) and func.attr in GROUP_METHODS:
            found.append((node.lineno, f".{func.attr}"))
        elif isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            owner = _dotted(func.value, modules)
            if owner in C10D_MODULES:
                found.append((node.lineno, f"{owner}.{func.attr}"))
    return found


def collectives_outside_comm(root: Path) -> list[str]:
    return [f"{name}:{line} calls {what}" for name, path in module_names(root).items()
            if not (name == COMM or name.startswith(COMM + "."))
            for line, what in c10d_calls(path.read_text())]


# ---- rule 4: no friend imports --------------------------------------------------------------------------
def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _private_owner(target: str, modules: dict[str, Path]) -> str | None:
    """The package inside which ``target`` (a dotted module or ``module.name``) may be imported (None: from
    anywhere). A private module ``P._m`` is ``P``'s; a private name of a private module ``P._m._n`` (or
    ``P._m.x._n``) is the package's that holds that module. Private names of public modules are PyTorch's API
    (``_FunctionalAdam``, ``_apply_optimizer_in_backward``) and free to import."""
    module = _deepest(target, modules) or target
    parts = module.split(".")
    first = next((position for position, part in enumerate(parts) if _private(part)), None)
    if first is None:
        return None
    name = target[len(module) + 1:]
    if name and _private(name):
        return module.rpartition(".")[0] if module not in _packages(modules) else module
    return ".".join(parts[:first])


def _packages(modules: dict[str, Path]) -> set[str]:
    return {name for name, path in modules.items() if path.name == "__init__.py"}


def friend_imports(root: Path) -> set[tuple[str, str]]:
    """(importer, private target) for every import of a private module or name from outside its package."""
    modules = module_names(root)
    found = set()
    for name, path in modules.items():
        for node in _every_import(ast.parse(path.read_text(), str(path))):
            for target in _targets(name, path, node, modules):
                if not target.startswith("tensorplay") or _deepest(target, modules) is None:
                    continue
                owner = _private_owner(target, modules)
                if owner is None:
                    continue
                if name != owner and not name.startswith(owner + "."):
                    found.add((name, target))
    return found


# ---- rule 5: fsdp does not import optim ------------------------------------------------------------------
FRONT_ENDS, OPTIMIZERS = "tensorplay.distributed.fsdp", "tensorplay.distributed.optim"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def front_ends_importing_optim(root: Path) -> set[tuple[str, str]]:
    modules = module_names(root)
    return {(name, target) for name, path in modules.items() if _within(name, FRONT_ENDS)
            for node in _every_import(ast.parse(path.read_text(), str(path)))
            for target in _targets(name, path, node, modules) if _within(target, OPTIMIZERS)}


# ---- the rules on src -----------------------------------------------------------------------------------
def test_src_has_no_import_cycle():
    graph = import_graph(SRC)
    classic = "tensorplay.distributed.fsdp._classic."
    assert classic + "runtime" in graph[classic + "fully_sharded_data_parallel"]  # the walk found the imports
    assert cycles(graph) == [], "import cycles (see the module docstring): " + "; ".join(
        " <-> ".join(c) for c in cycles(graph))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_within_a_package(package):
    graph = package_graph(DISTRIBUTED / package)
    assert cycles(graph) == [], f"{package}: import cycle {cycles(graph)}"


def test_only_comm_calls_c10d_collectives():
    assert collectives_outside_comm(SRC) == []
    assert c10d_calls((DISTRIBUTED / "_comm" / "collectives.py").read_text())  # the walk sees _comm's own


def _short(name: str) -> str:
    return name.removeprefix("tensorplay.distributed.") if name.startswith("tensorplay.distributed.") else \
        "~" + name.removeprefix("tensorplay.")


def test_no_friend_imports():
    found = {(_short(a), _short(b)) for a, b in friend_imports(SRC) if not _within(a, HARNESS)}
    assert found == set(), "friend imports (see rule 4): " + "; ".join(f"{a} imports {b}" for a, b in sorted(found))
    assert any(_within(a, HARNESS) for a, _ in friend_imports(SRC))  # the walk sees the harness's reads


def test_fsdp_does_not_import_optim():
    assert front_ends_importing_optim(SRC) == set()


# ---- each rule can fail ---------------------------------------------------------------------------------
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


def test_a_type_checking_cycle_within_a_package_is_found(tmp_path):
    _write(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "b.py": "def f():\n    from . import a\n",
        "c.py": "from .a import x\n",
    })
    assert cycles(package_graph(tmp_path)) == [("a", "b")]


def test_a_planted_collective_outside_comm_is_found(tmp_path):
    _write(tmp_path, {
        "tensorplay/__init__.py": "",
        "tensorplay/distributed/__init__.py": "",
        "tensorplay/distributed/_comm/__init__.py": "",
        "tensorplay/distributed/_comm/ok.py": "import torch.distributed as dist\ndist.all_reduce(t)\n",
        "tensorplay/distributed/optim/__init__.py": "",
        "tensorplay/distributed/optim/bad.py": (
            "import torch\nimport torch.distributed as dist\nimport tensorplay.distributed as tdist\n"
            "from torch.distributed import all_to_all_single as a2a\nfrom torch import distributed\n"
            "dist.get_rank()\ndist.all_reduce(t)\ntdist.broadcast_object_list(x)\na2a(o, i)\n"
            "distributed.distributed_c10d.gather_object(x)\ntorch.distributed.barrier()\n"
            "group.allreduce([t], options)\nmine.all_reduce(t)\n"),
    })
    assert collectives_outside_comm(tmp_path) == [
        "tensorplay.distributed.optim.bad:7 calls torch.distributed.all_reduce",
        "tensorplay.distributed.optim.bad:8 calls tensorplay.distributed.broadcast_object_list",
        "tensorplay.distributed.optim.bad:9 calls a2a",
        "tensorplay.distributed.optim.bad:10 calls torch.distributed.distributed_c10d.gather_object",
        "tensorplay.distributed.optim.bad:11 calls torch.distributed.barrier",
        "tensorplay.distributed.optim.bad:12 calls .allreduce",
    ]


def test_a_planted_friend_import_is_found(tmp_path):
    _write(tmp_path, {
        "tensorplay/__init__.py": "",
        "tensorplay/distributed/__init__.py": "",
        "tensorplay/distributed/_comm/__init__.py": "",
        "tensorplay/distributed/_comm/collectives.py": "_Watched = 1\nall_reduce = 2\n",
        "tensorplay/distributed/optim/__init__.py": "",
        "tensorplay/distributed/optim/_group.py": "from ._state import x\n",
        "tensorplay/distributed/optim/_state.py": "x = 1\n",
        "tensorplay/distributed/checkpoint/__init__.py": "",
        "tensorplay/distributed/checkpoint/bad.py": (
            "from tensorplay.distributed._comm.collectives import all_reduce, _Watched\n"
            "def f():\n    from ..optim import _group\n    import tensorplay.distributed.optim._state\n"),
    })
    assert friend_imports(tmp_path) == {
        ("tensorplay.distributed.checkpoint.bad", "tensorplay.distributed._comm.collectives._Watched"),
        ("tensorplay.distributed.checkpoint.bad", "tensorplay.distributed.optim._group"),
        ("tensorplay.distributed.checkpoint.bad", "tensorplay.distributed.optim._state"),
    }


def test_a_planted_optim_import_in_fsdp_is_found(tmp_path):
    _write(tmp_path, {
        "tensorplay/__init__.py": "",
        "tensorplay/distributed/__init__.py": "",
        "tensorplay/distributed/optim/__init__.py": "grad_ready = 1\n",
        "tensorplay/distributed/fsdp/__init__.py": "",
        "tensorplay/distributed/fsdp/_fully_shard/__init__.py": "",
        "tensorplay/distributed/fsdp/_fully_shard/bad.py": "def f():\n    from ...optim import grad_ready\n",
        "tensorplay/distributed/fsdp/ok.py": "from tensorplay.distributed import optimizer_free\n",
    })
    assert front_ends_importing_optim(tmp_path) == {
        ("tensorplay.distributed.fsdp._fully_shard.bad", "tensorplay.distributed.optim.grad_ready")}
