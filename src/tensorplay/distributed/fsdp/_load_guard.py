"""``load_state_dict`` of a plain module that holds sharded ones is all or nothing too.

[Note: load through a plain parent]
Classic FSDP and fully_shard modules check a state dict on every rank before
anything is copied (their ``load_state_dict``; see [Note: all-or-nothing loads] in
``_shard.load_check``). But ``nn.Sequential(FSDP(a), nn.Linear(4, 4)).load_state_dict``
is ``nn.Module``'s: it walks the tree copying module by module and never calls
the sharded module's method, so one bad key leaves a half-loaded model, and a
key bad on one rank only leaves the ranks disagreeing (what PyTorch does).

So a module that comes to hold a sharded module is *guarded*: its instance
``__dict__`` gets a ``load_state_dict`` (which shadows the class's method, so
``strict`` and ``assign`` arrive as given) that checks the whole state dict the
way the sharded modules do (:func:`check_module_load`), agreed across ranks, and
then calls the class's own ``load_state_dict``. Which modules: a module
registration hook (PyTorch's public ``register_module_module_registration_hook``,
installed once, on import) records each module's parents weakly and, when a
sharded or guarded module is registered under a parent, guards that parent and
its ancestors; ``fully_shard``, which changes a module's class in place and
registers nothing, calls :func:`guard_ancestors` itself. Sharded modules are not
guarded (their own method checks). Parents registered before this package was
imported are unknown: a sharded module's direct parent is still guarded when the
sharded module is registered there, deeper ancestors of such a tree are not.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import torch.nn.modules.module as torch_module
from torch import nn

from tensorplay.distributed.fsdp._classic.unit_state import STATE_ATTR

__all__ = ["check_module_load", "guard", "guard_ancestors", "is_guarded"]

#: child -> the modules it was registered under (weakly: a registry, never keeps a module alive).
_PARENTS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]] = weakref.WeakKeyDictionary()


def _is_sharded(module: nn.Module) -> bool:
    """A classic FSDP unit or a fully_shard module (both keep their state under the same instance attribute)."""
    return STATE_ATTR in module.__dict__


def is_guarded(module: nn.Module) -> bool:
    value = module.__dict__.get("load_state_dict")
    return isinstance(value, functools.partial) and value.func is _checked_load


def guard(module: nn.Module) -> None:
    """Make ``module.load_state_dict`` check the whole state dict first (see the note); idempotent."""
    if _is_sharded(module) or "load_state_dict" in module.__dict__:
        return  # checks itself, already guarded, or a user's own instance override
    module.__dict__["load_state_dict"] = functools.partial(_checked_load, module)


def guard_ancestors(module: nn.Module) -> None:
    """Guard every recorded ancestor of ``module`` (a module that has just come to hold a sharded one)."""
    seen: set[int] = set()
    pending = list(_parents(module))
    while pending:
        ancestor = pending.pop()
        if id(ancestor) in seen:
            continue
        seen.add(id(ancestor))
        guard(ancestor)
        pending.extend(_parents(ancestor))


def _parents(module: nn.Module) -> list[nn.Module]:
    try:
        return list(_PARENTS.get(module, ()))
    except TypeError:  # a module class that defines __eq__ without __hash__: not recorded
        return []


def _on_register(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """PyTorch's global module-registration hook: record ``parent``; guard it if ``child`` holds sharded state."""
    if child is None:
        return
    try:
        _PARENTS.setdefault(child, weakref.WeakSet()).add(parent)
    except TypeError:  # unhashable module class: cannot be recorded
        pass
    if _is_sharded(child) or is_guarded(child):
        guard(parent)
        guard_ancestors(parent)


def _checked_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True,
                  assign: bool = False) -> Any:
    """``load_state_dict`` of a guarded module: all or nothing on every rank, then the class's own method."""
    check_module_load(module, state_dict, strict)
    return type(module).load_state_dict(module, state_dict, strict, assign)


def check_module_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Raise one ``StateDictLoadError`` on every rank if ``state_dict`` does not fit ``module`` on any rank.

    ``module`` may hold classic FSDP units, fully_shard modules or neither (then a
    local check). Collective over the sharded modules' groups.
    """
    from tensorplay.distributed.fsdp._classic.state_dict_check import check_loadable, unit_groups
    from tensorplay.distributed.fsdp._classic.unit_state import named_states
    from tensorplay.distributed.fsdp._fully_shard._fsdp_load import check_load

    units = [unit for _, unit in named_states(module)]
    if units:
        check_loadable(module, units, state_dict, strict, unit_groups(units))
    else:
        check_load(module, state_dict, strict)


_REGISTRATION = torch_module.register_module_module_registration_hook(_on_register)
