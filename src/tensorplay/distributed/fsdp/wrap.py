"""Auto-wrap policies: which submodules become their own FSDP unit.

A policy is a callable ``policy(module, recurse, nonwrapped_numel) -> bool``,
asked twice per module during a bottom-up walk: with ``recurse=True`` ("look
inside this module's children?") and, after its children were handled, with
``recurse=False`` ("wrap this module itself?", ``nonwrapped_numel`` then counting
only the parameters not already taken by a wrapped descendant).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from .._checks.validation import check_callable, check_iterable

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


class WrapPolicy(Protocol):
    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool: ...


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module.

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import always_wrap_policy
        >>> model = FSDP(tp.nn.Sequential(tp.nn.Linear(8, 8), tp.nn.Linear(8, 2)), auto_wrap_policy=always_wrap_policy)
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        3
    """
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true.

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import lambda_auto_wrap_policy
        >>> policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, tp.nn.Linear))
        >>> model = FSDP(tp.nn.Sequential(tp.nn.Linear(8, 8), tp.nn.Linear(8, 2)), auto_wrap_policy=policy)
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        3
    """
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (use with ``functools.partial``).

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import transformer_auto_wrap_policy
        >>> layer_cls = {tp.nn.TransformerEncoderLayer}
        >>> policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
        >>> layer = tp.nn.TransformerEncoderLayer(16, 2, 32)
        >>> layers = tp.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> model = FSDP(layers, auto_wrap_policy=policy)     # one unit per layer, plus the root
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        3
    """
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


_FORCE_LEAF_MODULES = (nn.MultiheadAttention,)
_EXCLUDE_WRAP_MODULES = (nn.ModuleList, nn.ModuleDict)


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    The walk does not descend into ``force_leaf_modules`` (default
    ``nn.MultiheadAttention``) and never wraps ``exclude_wrap_modules``
    (default ``nn.ModuleList``, ``nn.ModuleDict``).

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import size_based_auto_wrap_policy
        >>> policy = functools.partial(size_based_auto_wrap_policy, min_num_params=50)   # units of at least 50 elements
        >>> model = FSDP(tp.nn.Sequential(tp.nn.Linear(8, 8), tp.nn.Linear(8, 2)), auto_wrap_policy=policy)
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        2
    """
    leaves = tuple(force_leaf_modules) if force_leaf_modules is not None else _FORCE_LEAF_MODULES
    excluded = tuple(exclude_wrap_modules) if exclude_wrap_modules is not None else _EXCLUDE_WRAP_MODULES
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, leaves)
    return is_large and not isinstance(module, excluded)


class ModuleWrapPolicy:
    """Wrap every instance of the given module classes.

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
        >>> model = FSDP(tp.nn.Sequential(tp.nn.Linear(8, 8), tp.nn.ReLU(), tp.nn.Linear(8, 2)),
        ...              auto_wrap_policy=ModuleWrapPolicy({tp.nn.Linear}))     # one unit per Linear, plus the root
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        3
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = check_iterable(module_classes, "module_classes", "ModuleWrapPolicy", optional=False,
                                 item_types=type)
        assert classes is not None  # optional=False
        self._module_classes = tuple(dict.fromkeys(classes))

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """With ``recurse``: whether to visit ``module``'s children (always); else whether to wrap it."""
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(c.__name__ for c in self._module_classes)})"


class CustomPolicy:
    """Wrap the modules for which ``lambda_fn(module)`` is truthy.

    A dict result wraps the module with those keyword arguments overriding the
    root's (for example ``{"sharding_strategy": ShardingStrategy.NO_SHARD}``).

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import CustomPolicy
        >>> policy = CustomPolicy(lambda m: {"use_orig_params": True} if isinstance(m, tp.nn.Linear) else False)
        >>> model = FSDP(tp.nn.Sequential(tp.nn.Linear(8, 8), tp.nn.Linear(8, 2)), auto_wrap_policy=policy)
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        3
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        checked = check_callable(lambda_fn, "lambda_fn", "CustomPolicy", optional=False)
        assert checked is not None  # optional=False
        self._lambda_fn = checked

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """With ``recurse``: whether to visit ``module``'s children (always); else whether to wrap it."""
        return True if recurse else bool(self._lambda_fn(module))

    def overrides(self, module: nn.Module) -> dict[str, Any]:
        """The keyword arguments ``lambda_fn`` returned for ``module`` (empty unless it returned a dict)."""
        result = self._lambda_fn(module)
        return dict(result) if isinstance(result, dict) else {}


def auto_wrap(root: nn.Module, policy: WrapPolicy, wrap_fn: Callable[[nn.Module, dict[str, Any]], nn.Module],
              skip: Callable[[nn.Module], bool], counted: Callable[[nn.Module], int],
              individually: tuple[type[nn.Module], ...] = ()) -> None:
    """Wrap ``root``'s descendants chosen by ``policy`` bottom-up, in place (``root`` itself is not wrapped).

    ``skip(module)`` marks modules the walk leaves alone (ignored modules,
    existing wrappers); ``counted(module)`` is the number of parameters of a
    module that still need a unit. Instances of ``individually`` are wrapped
    whatever the policy says, and then the walk enters every module (as
    PyTorch's or-combination with its wrap-by-class policy does).
    """

    _AutoWrap(policy, wrap_fn, skip, counted, individually).visit(root, counted(root))


@dataclass
class _AutoWrap:
    """One :func:`auto_wrap` walk (a class, not a recursive closure: that would be a reference cycle)."""

    policy: WrapPolicy
    wrap_fn: Callable[[nn.Module, dict[str, Any]], nn.Module]
    skip: Callable[[nn.Module], bool]
    counted: Callable[[nn.Module], int]
    individually: tuple[type[nn.Module], ...]

    def visit(self, module: nn.Module, numel: int) -> int | None:
        """Wrap inside ``module``; how many of its parameters wrapped descendants took (None: not entered)."""
        policy = self.policy
        if not self.individually and not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return None
        taken = 0
        for name, child in list(module.named_children()):
            if self.skip(child):
                continue
            child_numel = self.counted(child)
            child_taken = self.visit(child, child_numel)
            if child_taken is None:
                continue
            if isinstance(child, self.individually) or policy(module=child, recurse=False,
                                                              nonwrapped_numel=child_numel - child_taken):
                overrides = policy.overrides(child) if isinstance(policy, CustomPolicy) else {}
                setattr(module, name, self.wrap_fn(child, overrides))
                child_taken = child_numel
            taken += child_taken
        return taken


class _WrapContext:
    """The wrapper class and keyword arguments :func:`wrap` uses inside :func:`enable_wrap`."""

    active: tuple[Callable[..., nn.Module], dict[str, Any]] | None = None


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside this context :func:`wrap` wraps modules with ``wrapper_cls(module, **wrapper_kwargs)``.

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import enable_wrap, wrap
        >>> with enable_wrap(wrapper_cls=FSDP):
        ...     model = tp.nn.Sequential(wrap(tp.nn.Linear(8, 8)), tp.nn.Linear(8, 2))   # wrap() marks a unit
        >>> model = FSDP(model)
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        2
    """
    if _WrapContext.active is not None:
        raise RuntimeError("enable_wrap: contexts cannot be nested; exit the outer enable_wrap first")
    _WrapContext.active = (wrapper_cls, dict(wrapper_kwargs))
    try:
        yield
    finally:
        _WrapContext.active = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the class set by :func:`enable_wrap` (unchanged outside that context).

    Example:
        >>> import functools
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import enable_wrap, wrap
        >>> with enable_wrap(wrapper_cls=FSDP):
        ...     model = tp.nn.Sequential(wrap(tp.nn.Linear(8, 8)), tp.nn.Linear(8, 2))   # wrap() marks a unit
        >>> model = FSDP(model)
        >>> sum(isinstance(m, FSDP) for m in model.modules())
        2
    """
    if _WrapContext.active is None:
        return module
    wrapper_cls, kwargs = _WrapContext.active
    return wrapper_cls(module, **{**kwargs, **wrap_overrides})

