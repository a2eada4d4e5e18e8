"""Which modules each module is registered under: recorded from ``import tensorplay`` on, weakly.

``nn.Module`` knows its children, never its parents; the all-or-nothing load
([Note: load through a plain parent] in ``tensorplay.distributed.fsdp._load_guard``)
must find every ancestor of a module that becomes sharded. PyTorch's public
``register_module_module_registration_hook`` calls :func:`_record` for every
submodule registered anywhere in the process (``__setattr__``, ``add_module``,
containers), so the record covers every module registered after ``tensorplay``
was imported. It holds weak references only (it never keeps a module alive) and
is not rank state: ranks that are threads each build their own modules.
"""

from __future__ import annotations

import weakref

import torch.nn.modules.module as _torch_module
from torch import nn

__all__ = ["parents"]

#: child -> weak references to the modules it was registered under (usually one).
_PARENTS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = weakref.WeakKeyDictionary()


def parents(module: nn.Module) -> list[nn.Module]:
    """The live modules ``module`` was registered under since ``tensorplay`` was imported (maybe since replaced)."""
    try:
        refs = _PARENTS.get(module, ())
    except TypeError:  # a module class that defines __eq__ without __hash__: never recorded
        return []
    return [parent for parent in (ref() for ref in refs) if parent is not None]


def _record(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    if child is None:
        return
    try:
        refs = _PARENTS.get(child)
        if refs is None:
            _PARENTS[child] = (weakref.ref(parent),)
        elif all(ref() is not parent for ref in refs):
            _PARENTS[child] = (*refs, weakref.ref(parent))
    except TypeError:  # unhashable module class: cannot be recorded
        pass


_HANDLE = _torch_module.register_module_module_registration_hook(_record)
