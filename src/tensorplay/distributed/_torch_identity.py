"""Type identity with PyTorch's classes, never behaviour ([Note: type identity only]).

[Note: type identity only]
Frameworks (accelerate, Lightning, transformers, pipelining) decide with
``isinstance(x, torch.distributed.fsdp.FSDPModule)`` and the like whether to take
their FSDP / ZeRO path. Our classes therefore list PyTorch's class as a base,
and :func:`identity_only` makes sure that base contributes nothing but the
``isinstance`` answer: every attribute PyTorch's class (or one of its private
bases) defines resolves to ours, or to the shared base (``nn.Module``,
``Optimizer``) it would have resolved to without PyTorch's class, or else to a
loud refusal naming the attribute. A method we call through ``super()`` must
skip PyTorch's class explicitly (``nn.Module.x(self, ...)``): ``super()`` walks
the MRO past our class, where the rebinding cannot reach.

Enums cannot be subclassed, so ours compare and hash equal to PyTorch's member
of the same name instead (:class:`TorchEqualEnum`); our policy, config and enum
classes name their PyTorch twin (:func:`twin`) and our entry points turn
PyTorch's object into ours (:func:`as_ours`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

__all__ = ["OBJECT_BASICS", "TorchEqualEnum", "as_ours", "as_torchs", "identity_only", "is_identity_class", "twin"]

T = TypeVar("T", bound=type)

#: PyTorch's subtrees whose classes may appear in our MROs for type identity only.
_IDENTITY_MODULES = ("torch.distributed.fsdp", "torch.distributed.optim",
                     "torch.distributed.algorithms.model_averaging", "torch.distributed.algorithms.ddp_comm_hooks",
                     "torch.distributed._composable_state")

#: Class-level names that describe the class itself, not behaviour: the instance ``__dict__`` / ``__weakref__``
#: slots (the same C getset for every class), documentation, typing and ABC bookkeeping, dataclass metadata
#: (our dataclasses declare their own fields).
OBJECT_BASICS = frozenset({
    "__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "__annotations__", "__orig_bases__",
    "__parameters__", "__abstractmethods__", "_abc_impl", "__slotnames__", "__dataclass_fields__",
    "__dataclass_params__", "__match_args__", "__firstlineno__", "__static_attributes__",
})


def is_identity_class(cls: type) -> bool:
    """Whether ``cls`` is one of PyTorch's classes that we list as a base for type identity only."""
    return cls.__module__.startswith(_IDENTITY_MODULES)


def identity_only(cls: T) -> T:
    """Class decorator: PyTorch's bases of ``cls`` give ``isinstance`` and nothing else (see the note)."""
    mro = cls.__mro__
    for torch_cls in (c for c in mro if is_identity_class(c)):
        for name in torch_cls.__dict__:
            if name in OBJECT_BASICS:
                continue
            owner = next(c for c in mro if name in c.__dict__)
            if is_identity_class(owner):
                setattr(cls, name, _ours_or_refusal(cls, torch_cls, name))
    return cls


def _ours_or_refusal(cls: type, torch_cls: type, name: str) -> Any:
    """What ``name`` resolves to past PyTorch's classes in ``cls``'s MRO, else an error naming it."""
    for base in cls.__mro__:
        if name in base.__dict__ and not is_identity_class(base):
            return base.__dict__[name]
    what = f"{torch_cls.__module__}.{torch_cls.__qualname__}.{name}"
    message = (f"{cls.__qualname__}.{name}: {what} is PyTorch's internal; tensorplay's {cls.__qualname__} is a "
               f"{torch_cls.__qualname__} for isinstance checks only and does not offer it")
    if callable(torch_cls.__dict__[name]) and not isinstance(torch_cls.__dict__[name], type):
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(message)
        refuse.__name__ = name
        return refuse

    def missing(self: Any) -> Any:
        raise AttributeError(message)
    return property(missing)


#: Our policy / config / enum class -> PyTorch's class of the same role (filled at import, never changed after).
_TWINS: dict[type, type] = {}


def twin(torch_cls: type) -> Callable[[T], T]:
    """Class decorator: our class stands for PyTorch's ``torch_cls`` (its objects are accepted by ``as_ours``)."""
    def register(our_cls: T) -> T:
        if issubclass(our_cls, Enum):
            missing = sorted(set(torch_cls.__members__) - set(our_cls.__members__))  # type: ignore[attr-defined]
            if missing:
                raise TypeError(f"{our_cls.__qualname__}: PyTorch's enum has members {missing} that ours lacks")
        _TWINS[our_cls] = torch_cls
        return our_cls
    return register


def as_ours(value: Any, our_cls: type[Any]) -> Any:
    """``value`` as ``our_cls`` when it is an object of PyTorch's twin class (a member, a policy, a config)."""
    if isinstance(value, our_cls):
        return value
    match = next((ours for ours, torch_cls in _TWINS.items() if torch_cls is type(value)
                  and issubclass(ours, our_cls)), None)  # e.g. PyTorch's CPUOffloadPolicy for OffloadPolicy
    if match is None:
        return value
    our_cls, torch_cls = match, _TWINS[match]
    if isinstance(value, Enum):
        return our_cls[value.name]  # type: ignore[index]
    ours = {f.name for f in dataclasses.fields(our_cls)}
    theirs = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    unknown = sorted(set(theirs) - ours)
    if unknown:
        raise TypeError(f"PyTorch's {torch_cls.__qualname__} has field(s) {', '.join(unknown)} that tensorplay's "
                        f"{our_cls.__qualname__} lacks; pass tensorplay's {our_cls.__qualname__}")
    return our_cls(**theirs)


def as_torchs(value: Any) -> Any:
    """``value`` (our member or config) as an object of its PyTorch twin class, for PyTorch code that checks types."""
    torch_cls = _TWINS.get(type(value))
    if torch_cls is None:
        return value
    if isinstance(value, Enum):
        return torch_cls[value.name]  # type: ignore[index]
    return torch_cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})


class TorchEqualEnum(Enum):
    """An enum whose members equal (and hash as) the member of the same name of its PyTorch twin (``@twin``)."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Enum) and type(other) is _TWINS.get(type(self)):
            return other.name == self.name
        return self is other

    def __hash__(self) -> int:
        return hash(self._name_)  # as Enum's, so PyTorch's member of the same name finds our key
