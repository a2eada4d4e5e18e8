"""The API reference's contents: every public name of the packages we own, and the pages listing them.

Public follows PyTorch's rule (as ``tests/unit/test_dropin_surface.py`` does): a module is public when no part
of its path below ``tensorplay.distributed`` starts with ``_``; its names are its ``__all__``. Names PyTorch
keeps private but tells users to import (``_FunctionalAdam``, ``_NamedOptimizer``, ...) are listed too.
``conf.py`` writes one page per public module into ``docs/api/`` at build time; the docs tests import
``public_names()`` to check that every name has a docstring and a place in the reference.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOTS = (
    "tensorplay.distributed.optim",
    "tensorplay.distributed.fsdp",
    "tensorplay.distributed.algorithms.model_averaging",
    "tensorplay.distributed.algorithms.ddp_comm_hooks",
    "tensorplay.distributed.checkpoint",
)

#: Private by PyTorch's naming, public by its documentation and tests: users import these.
PRIVATE_BUT_USED: dict[str, tuple[str, ...]] = {
    "tensorplay.distributed.optim": (
        "_apply_optimizer_in_backward", "_get_in_backward_optimizers", "_FunctionalAdadelta",
        "_FunctionalAdagrad", "_FunctionalAdam", "_FunctionalAdamW", "_FunctionalAdamax",
        "_FunctionalRMSprop", "_FunctionalRprop", "_FunctionalSGD",
    ),
    "tensorplay.distributed.optim.named_optimizer": ("_NamedOptimizer",),
    "tensorplay.distributed.optim.zero_redundancy_optimizer": ("_broadcast_object",),
    "tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks": ("_allreduce_fut",),
    "tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks": (
        "_OptimizerHookState", "_hook_then_optimizer", "_OptimInBackwardHookState", "_apply_optim_in_backward_hook",
    ),
    "tensorplay.distributed.algorithms.ddp_comm_hooks.mixed_precision_hooks": (
        "_AllreduceUpcastHookState", "_reducer_allreduce_and_upcast_hook",
    ),
}


@dataclass(frozen=True)
class PublicName:
    module: str  # where the reference documents it
    name: str
    obj: Any

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def torch_path(self) -> str:
        return "torch" + self.path[len("tensorplay"):]

    @property
    def is_pytorchs(self) -> bool:
        """PyTorch's own object re-exported under our name (its docstring is PyTorch's)."""
        return (getattr(self.obj, "__module__", None) or "").startswith("torch.")


def public_modules() -> list[str]:
    names: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for root in ROOTS:
            package = importlib.import_module(root)
            names.append(root)
            for info in pkgutil.walk_packages(package.__path__, root + "."):
                if not any(part.startswith("_") for part in info.name.split(".")[2:]):
                    importlib.import_module(info.name)
                    names.append(info.name)
    return names


def _names_of(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    return sorted({*getattr(module, "__all__", ()), *PRIVATE_BUT_USED.get(module_name, ())})


def public_names() -> Iterator[PublicName]:
    """Every (module, name) pair of the public surface, in reference order; an object may appear more than once."""
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        for name in _names_of(module_name):
            yield PublicName(module_name, name, getattr(module, name))


def _directive(entry: PublicName) -> str:
    return "autoclass" if inspect.isclass(entry.obj) else "autofunction"


def _entry(entry: PublicName, first: dict[int, PublicName]) -> list[str]:
    if inspect.ismodule(entry.obj):
        return [f"- `{entry.name}`: the module [`{entry.obj.__name__}`]({entry.obj.__name__}.md)", ""]
    home = first.setdefault(id(entry.obj), entry)
    if home is not entry:
        return [f"- `{entry.name}`: the same object as {{py:obj}}`{home.path}`", ""]
    if not (inspect.isclass(entry.obj) or inspect.isroutine(entry.obj)):
        return ["```{eval-rst}", f".. py:data:: {entry.name}", f"   :value: {entry.obj!r}", "",
                f"   *{_origin(entry)}.*", "```", ""]
    options = ["   :members:", "   :show-inheritance:"] if inspect.isclass(entry.obj) and not entry.is_pytorchs else []
    return ["```{eval-rst}", f".. {_directive(entry)}:: {entry.path}", *options, "", f"   *{_origin(entry)}.*",
            "```", ""]


def _origin(entry: PublicName) -> str:
    if entry.is_pytorchs:
        return "PyTorch's own object, re-exported unchanged"
    return f"Ours; PyTorch's is ``{entry.torch_path}``, same signature"


def write_pages(out_dir: Path) -> list[str]:
    """One Markdown page per public module, plus an index; returns the page names (without suffix)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    first: dict[int, PublicName] = {}
    pages = []
    by_module: dict[str, list[PublicName]] = {}
    for entry in public_names():
        by_module.setdefault(entry.module, []).append(entry)
    for module_name, entries in by_module.items():
        lines = [f"# `{module_name}`", "", "```{eval-rst}", f".. automodule:: {module_name}", "   :no-members:",
                 "```", ""]
        for entry in entries:
            lines += _entry(entry, first)
        if not entries:
            lines += ["No public names of its own: the module exists at PyTorch's path.", ""]
        _write_if_changed(out_dir / f"{module_name}.md", "\n".join(lines))
        pages.append(module_name)
    count = len(first)
    index = ["# API reference", "",
             f"Every public name of the five packages we own: {count} objects under "
             f"{sum(len(e) for e in by_module.values())} import paths, generated from their docstrings. "
             "Each page is one public module; an object exported at several paths is documented at the first "
             "and linked from the others. PyTorch's signature is ours by design (`tests/unit/test_dropin_surface.py` "
             "checks it); differences from PyTorch are in each docstring.", "",
             "```{toctree}", ":maxdepth: 1", "", *pages, "```", ""]
    _write_if_changed(out_dir / "index.md", "\n".join(index))
    return pages


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
