"""From a ``tp.optim`` class to its functional form.

``functional_optim_map`` pairs each supported optimizer class with its
``_Functional*`` class. :func:`as_functional_optim` builds one with no parameters
(they arrive through ``step_param``: the DDP hooks' use);
:func:`functional_optim_from` builds one over a parameter list (ZeRO's DDP
overlap, the RPC DistributedOptimizer).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from tensorplay.distributed.optim.functional import _FunctionalOptimizer
from tensorplay.distributed.optim.functional_adadelta import _FunctionalAdadelta
from tensorplay.distributed.optim.functional_adagrad import _FunctionalAdagrad
from tensorplay.distributed.optim.functional_adam import _FunctionalAdam
from tensorplay.distributed.optim.functional_adamax import _FunctionalAdamax
from tensorplay.distributed.optim.functional_adamw import _FunctionalAdamW
from tensorplay.distributed.optim.functional_rmsprop import _FunctionalRMSprop
from tensorplay.distributed.optim.functional_rprop import _FunctionalRprop
from tensorplay.distributed.optim.functional_sgd import _FunctionalSGD

__all__ = ["as_functional_optim", "functional_optim_from", "functional_optim_map", "register_functional_optim"]

#: ``tp.optim`` class (or a registered key) -> functional optimizer class.
functional_optim_map: dict[Any, type] = {
    torch.optim.Adagrad: _FunctionalAdagrad,  # tp.optim is torch.optim; named directly for the type checker
    torch.optim.Adam: _FunctionalAdam,
    torch.optim.AdamW: _FunctionalAdamW,
    torch.optim.SGD: _FunctionalSGD,
    torch.optim.Adadelta: _FunctionalAdadelta,
    torch.optim.RMSprop: _FunctionalRMSprop,
    torch.optim.Rprop: _FunctionalRprop,
    torch.optim.Adamax: _FunctionalAdamax,
}


def register_functional_optim(key: Any, optim: type) -> None:
    """Map ``key`` (an optimizer class or any hashable) to a functional class; an existing key is kept.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalSGD
        >>> from tensorplay.distributed.optim.utils import as_functional_optim, register_functional_optim
        >>> class MySGD(tp.optim.SGD):
        ...     pass
        >>> register_functional_optim(MySGD, _FunctionalSGD)       # as_functional_optim(MySGD) now works
        >>> type(as_functional_optim(MySGD, lr=0.1)).__name__
        '_FunctionalSGD'
    """
    functional_optim_map.setdefault(key, optim)


def as_functional_optim(optim_cls: type, *args: Any, **kwargs: Any) -> Any:
    """The functional form of ``optim_cls`` with its hyper-parameters and no parameters yet.

    Parameters join on their first ``step_param(param, grad)``. ``args``/``kwargs``
    are ``optim_cls``'s options after ``params`` (``lr``, ``momentum`` ...).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import as_functional_optim
        >>> functional = as_functional_optim(tp.optim.Adam, lr=0.1)    # no parameters yet: it is told them per step
        >>> type(functional).__name__
        '_FunctionalAdam'
    """
    return _construct(_functional_class(optim_cls), [], args, kwargs)


def functional_optim_from(optim_cls: type, params: Iterable[Tensor], *args: Any, **kwargs: Any) -> Any:
    """The functional form of ``optim_cls`` over ``params`` (its ``step(gradients)`` follows their order).

    ``optim_cls`` may be a ``tp.optim`` class or a functional class itself; an empty
    ``params`` is allowed (a rank that owns no parameter).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.utils import functional_optim_from
        >>> weight = tp.nn.Parameter(tp.ones(2))
        >>> functional = functional_optim_from(tp.optim.SGD, [weight], lr=0.5)
        >>> functional.step([tp.ones(2)])
        >>> weight.detach()
        tensor([0.5000, 0.5000])
    """
    return _construct(_functional_class(optim_cls), list(params), args, kwargs)


def _create_functional_optim(functional_optim_cls: type, *args: Any, **kwargs: Any) -> Any:
    """``functional_optim_cls`` with no parameters yet (they arrive through ``step_param``)."""
    return functional_optim_cls([], *args, **kwargs, _allow_empty_param_list=True)


def _functional_class(optim_cls: type) -> type:
    if optim_cls in functional_optim_map:
        return functional_optim_map[optim_cls]
    if isinstance(optim_cls, type) and issubclass(optim_cls, _FunctionalOptimizer):
        return optim_cls
    supported = ", ".join(sorted(getattr(k, "__name__", repr(k)) for k in functional_optim_map))
    raise ValueError(f"optimizer class {getattr(optim_cls, '__name__', optim_cls)!r} has no functional form; "
                     f"supported: {supported} (or register one with register_functional_optim)")


def _construct(functional_cls: type, params: list[Tensor], args: tuple, kwargs: dict[str, Any]) -> Any:
    # Both entry points allow an empty list: parameters may arrive later (step_param) or not at all.
    return functional_cls(params, *args, **_accepted_kwargs(functional_cls, kwargs), _allow_empty_param_list=True)


def _accepted_kwargs(functional_cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop class-optimizer options the functional form lacks when they are off (None/False);
    refuse the ones that are on, naming them."""
    accepted = inspect.signature(functional_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(kwargs)
    unknown = {k: v for k, v in kwargs.items() if k not in accepted}
    active = {k: v for k, v in unknown.items() if v is not None and v is not False}
    if active:
        options = ", ".join(f"{k}={v!r}" for k, v in active.items())
        supported = ", ".join(k for k in accepted if k not in ("params", "_allow_empty_param_list"))
        raise TypeError(f"{functional_cls.__name__} does not support {options}; its options are: {supported}")
    return {k: v for k, v in kwargs.items() if k in accepted}
