"""A parameter shared by two fully_shard groups: refused where both of its FQNs in the model are known.

[Note: naming a parameter shared across groups]
Sharding replaces a parameter in the modules of its own call only; where it is
also registered outside them (a tied embedding and head), the original stays
there, carrying ``_fsdp_sharded_as`` (the earlier call's name for it and a weak
reference to that call's module). A later call whose modules contain both
registrations refuses it at once, naming both FQNs under its own module (the
model, when it is the root). A sibling call cannot: ``nn.Module`` does not know
its parents, so it leaves the parameter alone and the check runs again at the
parent's ``fully_shard`` and at the root's lazy init, where ``named_modules``
names both. PyTorch refuses it at the root's first forward, naming one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn

__all__ = ["check_shared_across_groups", "is_sharded_elsewhere"]


def is_sharded_elsewhere(param: nn.Parameter) -> bool:
    """Whether an earlier fully_shard call sharded ``param`` (its original is still registered here)."""
    return hasattr(param, "_fsdp_sharded_as")


def check_shared_across_groups(modules: tuple[nn.Module, ...], skip: Iterable[nn.Parameter] = (),
                               *, final: bool = False) -> None:
    """Refuse a parameter registered under ``modules`` that an earlier call sharded elsewhere.

    Raises when the earlier call's module is under ``modules`` too (both FQNs known), or
    when ``final`` (the root's lazy init: nothing above it will know more).
    """
    skipped = set(skip)
    names = _module_names(modules)
    for fqn, holder, param in _registrations(modules):
        if param in skipped or not is_sharded_elsewhere(param):
            continue
        other, owner_ref = param._fsdp_sharded_as  # type: ignore[attr-defined]  # our marker (FSDPParam)
        owner = owner_ref()
        where = names.get(id(owner)) if owner is not None else None
        if where is not None:
            raise _both_named(fqn, f"{where}.{other}" if where else other, where)
        if final:
            raise _named_apart(fqn, holder, other, owner)


def _module_names(modules: tuple[nn.Module, ...]) -> dict[int, str]:
    names: dict[int, str] = {}
    for top in modules:
        for name, sub in top.named_modules(remove_duplicate=False):
            names.setdefault(id(sub), name)
    return names


def _registrations(modules: tuple[nn.Module, ...]) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """Every (FQN, module, parameter) registration under ``modules``, nested fully_shard modules included."""
    for top in modules:
        for prefix, sub in top.named_modules(remove_duplicate=False):
            for name, param in sub._parameters.items():
                if param is not None:
                    yield (f"{prefix}.{name}" if prefix else name), sub, param


_FIX = "put every module that uses it in one group, e.g. fully_shard([module_a, module_b]), or shard only their "\
       "common parent"


def _both_named(fqn: str, theirs: str, where: str) -> ValueError:
    return ValueError(f"fully_shard: parameter '{fqn}' is shared with '{theirs}', which an earlier fully_shard "
                      f"call (on '{where}') already sharded; {_FIX}")


def _named_apart(fqn: str, holder: nn.Module, other: str, owner: nn.Module | None) -> ValueError:
    """The root does not contain the earlier call's module: each is named under its own module."""
    owner_name = type(owner).__name__ if owner is not None else "module"
    return ValueError(f"fully_shard: parameter '{fqn}' of this root's {type(holder).__name__} is shared with "
                      f"'{other}' of the {owner_name} an earlier fully_shard call already sharded, which is "
                      f"not inside this root; {_FIX}")
