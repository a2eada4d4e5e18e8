"""Argument checks at the public boundary: one clear ValueError/TypeError naming the argument and the value.

Every public constructor and setter of the sharding layer validates its
arguments here before it changes anything, so a wrong type never surfaces as an
AttributeError, KeyError or AssertionError from deep inside, and a rejected
call leaves no hook, buffer or registration behind. Messages read
``"<where>: <name> must be <what>, got <value!r> (<type>)"``.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any, TypeVar

import torch

__all__ = ["check_bool", "check_callable", "check_dtype", "check_enum", "check_instance", "check_int",
           "check_iterable", "check_mapping", "check_real", "check_process_group"]

E = TypeVar("E", bound=Enum)


def _got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


def check_bool(value: Any, name: str, where: str) -> bool:
    """``value`` if it is a bool (numpy bools too), else a TypeError."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{where}: {name} must be a bool (True or False), {_got(value)}")


def check_int(value: Any, name: str, where: str, minimum: int | None = None) -> int:
    """``value`` as an int (not a bool, not a float) no smaller than ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be an int, {_got(value)}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int, {_got(value)}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum} (an int), {_got(value)}")
    return number


def check_real(value: Any, name: str, where: str, *, above: float | None = None, at_least: float | None = None,
               below: float | None = None, at_most: float | None = None) -> float:
    """``value`` as a finite real number within the given bounds (a 0-dim tensor counts as a number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        number = float(value.item())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{where}: {name} must be a real number, {_got(value)}")
    bounds = [(above, number > above if above is not None else True, f"> {above}"),
              (at_least, number >= at_least if at_least is not None else True, f">= {at_least}"),
              (below, number < below if below is not None else True, f"< {below}"),
              (at_most, number <= at_most if at_most is not None else True, f"<= {at_most}")]
    failed = [text for bound, ok, text in bounds if bound is not None and not ok]
    if number != number or failed:  # NaN fails every bound
        wanted = " and ".join(text for bound, _, text in bounds if bound is not None) or "a number, not NaN"
        raise ValueError(f"{where}: {name} must be {wanted}, {_got(value)}")
    return number


def check_enum(value: Any, enum_cls: type[E], name: str, where: str, optional: bool = False) -> E | None:
    """``value`` if it is a member of ``enum_cls`` (or None when ``optional``); a string gets a hint."""
    if isinstance(value, enum_cls) or (optional and value is None):
        return value
    members = ", ".join(f"{enum_cls.__name__}.{m.name}" for m in enum_cls)
    hint = ""
    if isinstance(value, str) and value.upper() in enum_cls.__members__:
        hint = f"; pass {enum_cls.__name__}.{value.upper()}, not the string"
    raise TypeError(f"{where}: {name} must be one of {members}{' or None' if optional else ''}, "
                    f"{_got(value)}{hint}")


def check_dtype(value: Any, name: str, where: str, optional: bool = True) -> torch.dtype | None:
    """``value`` if it is a ``torch.dtype`` (or None when ``optional``); a string gets a hint."""
    if isinstance(value, torch.dtype) or (optional and value is None):
        return value
    hint = ""
    if isinstance(value, str):
        hint = "; pass a torch.dtype such as tp.bfloat16, not a string"
    raise TypeError(f"{where}: {name} must be a torch.dtype{' or None' if optional else ''}, {_got(value)}{hint}")


def check_instance(value: Any, types: type | tuple[type, ...], name: str, where: str, optional: bool = False,
                   hint: str = "") -> Any:
    """``value`` if it is an instance of ``types`` (or None when ``optional``)."""
    if isinstance(value, types) or (optional and value is None):
        return value
    kinds = types if isinstance(types, tuple) else (types,)
    wanted = " or ".join(t.__name__ for t in kinds) + (" or None" if optional else "")
    article = "an" if wanted[0] in "AEIOU" else "a"
    raise TypeError(f"{where}: {name} must be {article} {wanted}, {_got(value)}{'; ' + hint if hint else ''}")


def check_callable(value: Any, name: str, where: str, optional: bool = True) -> Callable[..., Any] | None:
    if callable(value) or (optional and value is None):
        return value
    raise TypeError(f"{where}: {name} must be callable{' or None' if optional else ''}, {_got(value)}")


def check_iterable(value: Any, name: str, where: str, optional: bool = True,
                   item_types: type | tuple[type, ...] | None = None) -> list[Any] | None:
    """``value`` as a list (strings and tensors are not accepted as iterables), each item of ``item_types``."""
    if optional and value is None:
        return None
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        raise TypeError(f"{where}: {name} must be an iterable{' or None' if optional else ''}, {_got(value)}")
    items = list(value)
    if item_types is not None:
        kinds = item_types if isinstance(item_types, tuple) else (item_types,)
        for index, item in enumerate(items):
            if not isinstance(item, kinds):
                wanted = " or ".join(t.__name__ for t in kinds)
                raise TypeError(f"{where}: {name}[{index}] must be a {wanted}, {_got(item)}")
    return items


def check_mapping(value: Any, name: str, where: str, optional: bool = True) -> Mapping[Any, Any] | None:
    if isinstance(value, Mapping) or (optional and value is None):
        return value
    raise TypeError(f"{where}: {name} must be a dict{' or None' if optional else ''}, {_got(value)}")


def check_process_group(value: Any, name: str, where: str, optional: bool = True) -> Any:
    """``value`` if it is a ``ProcessGroup`` (or None when ``optional``)."""
    from tensorplay.distributed import GroupMember, ProcessGroup

    if value is GroupMember.NON_GROUP_MEMBER:  # what new_group returns on a rank outside the group
        return value
    return check_instance(value, ProcessGroup, name, where, optional=optional,
                          hint="pass a group from tensorplay.distributed.new_group(...), or None for the default group")
