"""Expose PyTorch's modules under ``tensorplay`` names without copying them.

``import tensorplay.nn.parallel`` must give back the very module object that is
``torch.nn.parallel`` (so ``tp.nn.Linear is torch.nn.Linear``), never a second
copy of the torch source imported under a new name. A meta-path finder, placed
first, answers every ``tensorplay.*`` name that has no file of ours with the torch
module of the same dotted path. Names inside the owned subtrees are never
answered: a missing file there is an ImportError, not a fall-through to PyTorch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

OUR_ROOT = "tensorplay"
TORCH_ROOT = "torch"

#: Subtrees whose every object is defined in this repo (docs/architecture.md, "Who owns what").
OWNED_SUBTREES: tuple[str, ...] = (
    "tensorplay.distributed.optim",
    "tensorplay.distributed.fsdp",
    "tensorplay.distributed.algorithms.model_averaging",
    "tensorplay.distributed.algorithms.ddp_comm_hooks",
    # PyTorch's older path of fully_shard; our package there re-exports our objects.
    "tensorplay.distributed._composable.fsdp",
)


def is_owned(fullname: str) -> bool:
    return any(fullname == root or fullname.startswith(root + ".") for root in OWNED_SUBTREES)


def torch_name(fullname: str) -> str:
    return TORCH_ROOT + fullname[len(OUR_ROOT):]


class _AliasLoader(importlib.abc.Loader):
    """Hands back an already-imported torch module as the module for our name."""

    def __init__(self, target: ModuleType) -> None:
        self._target = target
        self._target_spec = target.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._target

    def exec_module(self, module: ModuleType) -> None:
        # The import machinery stamps our spec on the module; torch's own must stay.
        module.__spec__ = self._target_spec


class TorchAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[override]
        if not fullname.startswith(OUR_ROOT + ".") or is_owned(fullname):
            return None
        parent_name = fullname.rpartition(".")[0]
        parent = sys.modules.get(parent_name)
        parent_is_ours = parent is not None and parent.__name__.startswith(OUR_ROOT)
        if parent_is_ours and self._has_own_file(fullname, parent):
            return None
        try:
            target_module = importlib.import_module(torch_name(fullname))
        except ImportError:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target_module))

    @staticmethod
    def _has_own_file(fullname: str, parent: ModuleType) -> bool:
        search = getattr(parent, "__path__", None)
        if search is None:
            return False
        return importlib.machinery.PathFinder.find_spec(fullname, search) is not None


def install() -> None:
    if not any(isinstance(f, TorchAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchAliasFinder())


def alias_attribute(module_name: str, name: str) -> object:
    """``getattr`` fallback for our real packages.

    Our own submodule file wins; then torch's attribute of that name; then torch's
    submodule (aliased). Owned subtrees never fall through.
    """
    fullname = f"{module_name}.{name}"
    module = sys.modules[module_name]
    if is_owned(fullname) or TorchAliasFinder._has_own_file(fullname, module):
        try:
            return importlib.import_module(fullname)
        except ImportError:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}") from None
    torch_module = importlib.import_module(torch_name(module_name))
    try:
        return getattr(torch_module, name)
    except AttributeError:
        pass
    try:
        return importlib.import_module(fullname)
    except ImportError:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}") from None
