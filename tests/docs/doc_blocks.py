"""Find the runnable code of the documentation and run it on 1-2 Gloo ranks.

Pages: every fenced ```python block of ``README.md`` and ``docs/*.md``. A block runs on the ranks its first line
asks for (``# ranks: 2``; one rank otherwise), every rank executing the whole block in a fresh namespace inside a
fresh temporary directory shared by the ranks. ``init_process_group`` and ``destroy_process_group`` are no-ops
there (the pooled workers already hold the default group), so a block can show them as a program would. A block
whose first line is ``# not run: <why>`` is skipped with that reason (a launcher command, a hardware-only path).

Docstrings: every ``>>>`` example of a public object of ours (``docs/_api.public_names()``) runs as a doctest on
one rank, outputs compared.
"""

from __future__ import annotations

import contextlib
import doctest
import functools
import importlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_RANKS = re.compile(r"#\s*ranks:\s*(\d+)")
_NOT_RUN = re.compile(r"#\s*not run:\s*(.+)")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    source: str

    @property
    def first_line(self) -> str:
        return self.source.split("\n", 1)[0]

    @property
    def world_size(self) -> int:
        found = _RANKS.search(self.first_line)
        return int(found.group(1)) if found else 1

    @property
    def skip_reason(self) -> str | None:
        found = _NOT_RUN.search(self.first_line)
        return found.group(1).strip() if found else None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def page_blocks() -> list[Block]:
    blocks = []
    for page in doc_pages():
        text = page.read_text()
        for found in _FENCE.finditer(text):
            line = text.count("\n", 0, found.start()) + 2
            blocks.append(Block(str(page.relative_to(ROOT)), line, found.group(1)))
    return blocks


@contextlib.contextmanager
def _as_a_program(workdir: str) -> Iterator[None]:
    """Inside a pooled worker: the group exists already, so a block's init/destroy calls do nothing."""
    import torch.distributed as c10d

    import tensorplay.distributed as dist

    saved = {name: getattr(c10d, name) for name in ("init_process_group", "destroy_process_group")}
    previous = os.getcwd()
    for name in saved:
        setattr(c10d, name, lambda *args, **kwargs: None)
        setattr(dist, name, lambda *args, **kwargs: None)
    os.chdir(workdir)
    try:
        yield
    finally:
        os.chdir(previous)
        for name, fn in saved.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def exec_block(source: str, name: str, workdir: str) -> None:
    """Run one page block on this rank (module level: pickled to the workers)."""
    code = compile(source, name, "exec")
    with _as_a_program(workdir):
        exec(code, {"__name__": "__main__"})


# -- docstrings ------------------------------------------------------------------------------------------------


def _docs_api() -> Any:
    if str(DOCS) not in sys.path:
        sys.path.insert(0, str(DOCS))
    return importlib.import_module("_api")


@functools.cache
def docstring_tests() -> dict[str, doctest.DocTest]:
    """The doctests of our public objects (each object once, at its first documented path), by path."""
    api = _docs_api()
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    seen: set[int] = set()
    tests: dict[str, doctest.DocTest] = {}
    for entry in api.public_names():
        if entry.is_pytorchs or id(entry.obj) in seen or isinstance(entry.obj, type(sys)):
            continue
        seen.add(id(entry.obj))
        for test in finder.find(entry.obj, entry.path, module=False, globs={}):
            if test.examples and _defined_here(test.name, entry):
                tests.setdefault(test.name, test)
    return tests


def _defined_here(test_name: str, entry: Any) -> bool:
    # Methods found by recursion are ours only when their class is.
    return test_name.startswith(entry.path)


def run_docstring(test_name: str, workdir: str) -> str:
    """Run one docstring's doctest on this rank; returns the failure report ('' when it passed)."""
    test = docstring_tests()[test_name]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    with _as_a_program(workdir):
        runner.run(test, out=out.append)
    return "".join(out)
