"""The API reference covers every public name of the five packages we own, each with a docstring.

``docs/_api.py`` decides what is public (PyTorch's rule, as the drop-in surface test) and writes the reference
pages; these tests check the pages against that list, so a name added to an ``__all__`` without a docstring or
a place in the reference fails here.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from tests.docs import doc_blocks

api = doc_blocks._docs_api()


def _ours_once() -> list:
    seen: set[int] = set()
    entries = []
    for entry in api.public_names():
        if inspect.ismodule(entry.obj) or id(entry.obj) in seen:
            continue
        seen.add(id(entry.obj))
        entries.append(entry)
    return entries


def test_every_public_object_of_ours_has_a_docstring() -> None:
    missing = [e.path for e in _ours_once() if not e.is_pytorchs and inspect.isclass(e.obj) | inspect.isroutine(e.obj)
               and not (inspect.getdoc(e.obj) or "").strip()]
    assert missing == [], f"public names without a docstring: {missing}"


def test_every_public_name_is_in_the_reference(tmp_path: Path) -> None:
    api.write_pages(tmp_path)
    entries = list(api.public_names())
    absent = []
    for entry in entries:
        page = (tmp_path / f"{entry.module}.md").read_text()
        forms = (f":: {entry.path}\n", f":: {entry.name}\n", f"- `{entry.name}`: ")  # documented, or linked
        absent += [] if any(form in page for form in forms) else [entry.path]
    assert absent == [], f"public names missing from the API reference: {absent}"
    assert len(entries) >= 180, len(entries)  # the surface only grows: shrinking it breaks users


def test_every_public_module_has_a_page(tmp_path: Path) -> None:
    assert api.write_pages(tmp_path) == api.public_modules()
    for root in api.ROOTS:
        assert root in api.public_modules()


#: Public objects of ours whose docstring has a runnable ``>>>`` example (run by test_doc_blocks): all but RPC's
#: DistributedOptimizer (it needs an RPC world) and the two private mixed-precision hook internals.
EXAMPLES_AT_LEAST = 106


def test_public_objects_have_examples() -> None:
    ours = [e for e in _ours_once() if not e.is_pytorchs and (inspect.isclass(e.obj) or inspect.isroutine(e.obj))]
    without = [e.path for e in ours if ">>>" not in (inspect.getdoc(e.obj) or "")]
    with_examples = len(ours) - len(without)
    assert with_examples >= EXAMPLES_AT_LEAST, f"{with_examples} of {len(ours)} have an example; without: {without}"
