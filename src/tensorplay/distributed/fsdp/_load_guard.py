"""``load_state_dict`` of a plain module that holds sharded ones is all or nothing too.

[Note: load through a plain parent]
Classic FSDP and fully_shard modules check a state dict on every rank before
anything is copied (their ``load_state_dict``; see [Note: all-or-nothing loads] in
``_checks.load_check``). But ``nn.Sequential(FSDP(a), nn.Linear(4, 4)).load_state_dict``
is ``nn.Module``'s: it walks the tree copying module by module and never calls
the sharded module's method, so one bad key leaves a half-loaded model, and a
key bad on one rank only leaves the ranks disagreeing (what PyTorch does).

So a module that comes to hold a sharded module is *guarded*: its instance
``__dict__`` gets a ``load_state_dict`` (which shadows the class's method, so
``strict`` and ``assign`` arrive as given) that checks the whole state dict the
way the sharded modules do (:func:`check_module_load`), agreed across ranks, and
then calls the class's own ``load_state_dict``. Which modules:
``tensorplay._module_parents`` records every module's parents from ``import
tensorplay`` on; a module-registration hook (PyTorch's public
``register_module_module_registration_hook``, installed when this package is
imported) guards the parent, and its ancestors, of every sharded or guarded
module registered; ``fully_shard``, which changes a module's class in place and
registers nothing, calls :func:`guard_ancestors` itself. Sharded modules are not
guarded (their own method checks). Modules registered before ``tensorplay`` was
imported have no recorded parents: a sharded module's direct parent is still
guarded when the sharded module is registered there, deeper ancestors of such a
tree are not (import ``tensorplay`` before building the model); a sharded module
then warns when it is loaded through an ancestor whose place is not recorded
(:func:`watch_loads`: the load's key prefix is deeper than its recorded ancestry).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch.nn.modules.module as torch_module
from torch import nn

from tensorplay._module_parents import parents
from tensorplay.distributed.fsdp._classic.unit_state import STATE_ATTR

__all__ = ["check_module_load", "guard", "guard_ancestors", "is_guarded", "watch_loads"]


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
    pending = parents(module)
    while pending:
        ancestor = pending.pop()
        if id(ancestor) in seen:
            continue
        seen.add(id(ancestor))
        guard(ancestor)
        pending.extend(parents(ancestor))


def watch_loads(module: nn.Module) -> None:
    """Make the sharded ``module`` warn when a load reaches it through an unrecorded (so unguarded) ancestor."""
    hooks = module._load_state_dict_pre_hooks.values()
    if all(getattr(hook, "hook", None) is not _warn_if_unguarded for hook in hooks):
        module._register_load_state_dict_pre_hook(_warn_if_unguarded, with_module=True)


def _depth(module: nn.Module, seen: frozenset[int] = frozenset()) -> int:
    """How many recorded ancestors lie above ``module`` on its deepest recorded path."""
    above = [p for p in parents(module) if id(p) not in seen]
    return 1 + max(_depth(p, seen | {id(module)}) for p in above) if above else 0


def _warn_if_unguarded(module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
    if prefix and prefix.count(".") > _depth(module):
        warnings.warn(f"load_state_dict reached the sharded {type(module).__name__} at {prefix[:-1]!r} through a "
                      "module registered before tensorplay was imported: that load was not checked all or nothing "
                      "(import tensorplay before building the model, or call load_state_dict on the sharded module)",
                      UserWarning, stacklevel=2)


def _on_register(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """PyTorch's global module-registration hook: guard ``parent`` and its ancestors if ``child`` holds sharded
    state (``_module_parents``'s hook, installed first, has recorded ``parent`` already)."""
    if child is not None and (_is_sharded(child) or is_guarded(child)):
        if _is_sharded(child):
            watch_loads(child)
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
