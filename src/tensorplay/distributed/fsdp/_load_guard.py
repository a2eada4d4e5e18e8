"""Loads that reach a sharded module through a plain parent: the sharded part is checked first.

[Note: load through a plain parent]
Classic FSDP and fully_shard modules check a state dict on every rank before
anything is copied (their ``load_state_dict``; see [Note: all-or-nothing loads] in
``_checks.load_check``). ``nn.Sequential(FSDP(a), nn.Linear(4, 4)).load_state_dict``
is ``nn.Module``'s: it walks the tree copying module by module and never calls the
sharded module's method. We touch only the modules we shard (as PyTorch's FSDPs
do): each gets a load pre-hook (:func:`check_loads_through_parents`, registered
when it is wrapped) that, when such a walk reaches it, checks its own part of the
state dict on every rank of its groups, agreed, and raises one
``StateDictLoadError`` on every rank before any of that part is copied. Sharded
modules inside it are covered by that check (marked with the walk's ``error_msgs``
list, the one object a walk passes every hook) and do not check again.

What the hook cannot do: see the plain modules. They are ``nn.Module``'s, copied
one by one as the walk meets them (an earlier plain linear is already copied when
the sharded part refuses), and missing or unexpected keys are reported at the end
by ``nn.Module`` (a pre-hook is not told whether ``strict`` was set, so the
sharded part's check is on shapes and layouts only). A load that is all or nothing
over the whole model goes through one of our own paths: the root's
``load_state_dict`` when the root is sharded (``fully_shard(model)``,
``FullyShardedDataParallel(model)``), or the checkpoint package's
``set_model_state_dict`` / ``set_state_dict``, which check the whole state dict
first (:func:`checked_whole_load`). Nothing depends on import order: no global
hook, no method written onto a user's module.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

from tensorplay.distributed._checks.whole_load import offer_whole_load_check
from tensorplay.distributed.fsdp._classic.unit_state import STATE_ATTR

__all__ = ["check_loads_through_parents", "check_module_load", "checked_whole_load", "is_sharded"]

_CHECKED_ATTR = "_tensorplay_load_checked"
"""Instance attribute of a sharded module whose part of the load in progress is already checked."""

_BY_CALLER = object()
"""Marker value: the caller checked the whole state dict (:func:`checked_whole_load`)."""


def is_sharded(module: nn.Module) -> bool:
    """A classic FSDP unit or a fully_shard module (both keep their state under the same instance attribute)."""
    return STATE_ATTR in module.__dict__


def check_loads_through_parents(module: nn.Module) -> None:
    """Give the sharded ``module`` the load pre-hook of the note (call before its other load pre-hooks); idempotent."""
    hooks = module._load_state_dict_pre_hooks.values()
    if all(getattr(hook, "hook", None) is not _check_reached_part for hook in hooks):
        module._register_load_state_dict_pre_hook(_check_reached_part, with_module=True)
    offer_whole_load_check(module, checked_whole_load)


def _check_reached_part(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any,
                        strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                        error_msgs: list[str]) -> None:
    """Load pre-hook: check this sharded module's part when a plain parent's walk reaches it (see the note)."""
    marker = module.__dict__.get(_CHECKED_ATTR)
    if marker is _BY_CALLER or marker is error_msgs:
        return  # a sharded ancestor's check or the caller's covered this part
    if prefix:  # an empty prefix: the load began here, and our load_state_dict checked already
        part = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
        check_module_load(module, part, strict=False)
    for inner in module.modules():
        if inner is not module and is_sharded(inner):
            inner.__dict__[_CHECKED_ATTR] = error_msgs


@contextmanager
def checked_whole_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> Iterator[None]:
    """Check ``state_dict`` against all of ``module`` on every rank, then load inside without checking again."""
    check_module_load(module, state_dict, strict)
    sharded = [m for m in module.modules() if is_sharded(m)]
    previous = [m.__dict__.get(_CHECKED_ATTR) for m in sharded]
    for m in sharded:
        m.__dict__[_CHECKED_ATTR] = _BY_CALLER
    try:
        yield
    finally:
        for m, value in zip(sharded, previous, strict=True):
            m.__dict__[_CHECKED_ATTR] = value


def check_module_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Raise one ``StateDictLoadError`` on every rank if ``state_dict`` does not fit ``module`` on any rank.

    ``module`` may hold classic FSDP units, fully_shard modules or neither (then a
    local check). Collective over the sharded modules' groups.
    """
    from tensorplay.distributed.fsdp._classic.load_check import check_loadable, unit_groups
    from tensorplay.distributed.fsdp._classic.unit_state import named_states
    from tensorplay.distributed.fsdp._fully_shard._fsdp_load_check import check_load

    units = [unit for _, unit in named_states(module)]
    if units:
        check_loadable(module, units, state_dict, strict, unit_groups(units))
    else:
        check_load(module, state_dict, strict)
