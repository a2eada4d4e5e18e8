"""The "gradient ready" hook point between the front ends and whatever steps in backward.

A front end that writes a parameter's final gradient itself (fully_shard's
reduce-scatter, the classic FSDP's flat shard, DDP's bucket) calls
:func:`grad_ready`; the hooks registered on that parameter (the optimizers
applied in backward register one) run then. Registrations live on the parameter:
nothing global, and no front end needs to know what registered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["GradReadyHook", "grad_ready", "has_grad_ready_hook", "register_grad_ready_hook"]

#: ``hook(param, shard_groups, ranks)``: ``shard_groups`` are the groups a plain-tensor gradient is a shard over,
#: ``ranks`` the groups that together hold every rank training the parameter.
GradReadyHook = Callable[[torch.Tensor, tuple[object, ...], tuple[object, ...]], None]

_HOOKS = "_grad_ready_hooks"


def register_grad_ready_hook(param: torch.Tensor, hook: GradReadyHook) -> None:
    """Run ``hook`` whenever a front end says ``param``'s gradient is final (once per hook and parameter)."""
    hooks: list[GradReadyHook] = getattr(param, _HOOKS, None) or []
    if hook not in hooks:
        setattr(param, _HOOKS, [*hooks, hook])


def has_grad_ready_hook(param: torch.Tensor) -> bool:
    return bool(getattr(param, _HOOKS, None))


def grad_ready(param: torch.Tensor, shard_groups: tuple[object, ...] = (), ranks: tuple[object, ...] = ()) -> None:
    """``param.grad`` is final for this backward: run the hooks registered on ``param``, in order."""
    for hook in getattr(param, _HOOKS, ()):
        hook(param, shard_groups, ranks)
