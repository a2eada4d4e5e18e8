"""Classic FSDP with optimizers applied in backward: step each unit's parameters once its gradient shard lands.

    model = FullyShardedDataParallel(model, use_orig_params=True, ...)
    apply_optimizer_in_backward(tp.optim.Adam, model.parameters(), {"lr": 1e-3})
    model(x).sum().backward()   # each unit stepped after its reduce-scatter; its gradient shard freed

The handle calls :func:`sharded_grad_ready` once its reduced gradient shard is
in ``.grad`` (after ``no_sync`` micro-batches too, when the accumulated
gradient is reduced). With ``use_orig_params=True`` the original parameters
(views of the flat shard) are stepped; otherwise the flat parameter is. Their
gradients are views of the flat parameter's gradient, which is dropped once
none of them keeps its gradient (clipping in ``"exact"`` mode or accumulation
keep them).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tensorplay.distributed._sharding.grad_ready import grad_ready, has_grad_ready_hook

__all__ = ["sharded_grad_ready"]


class _Handle(Protocol):
    """What is read of a ``FlatParamHandle`` (a Protocol: the handle's module imports this one)."""

    views: Any
    plan: Any

    @property
    def flat_param(self) -> torch.Tensor: ...

    @property
    def is_sharded_over_ranks(self) -> bool: ...


def sharded_grad_ready(handle: _Handle) -> None:
    """``handle``'s reduced gradient shard is in ``.grad``: hand its in-backward parameters to their optimizers."""
    params = handle.views.registered(handle)
    stepped = [param for param in params if has_grad_ready_hook(param)]
    if not stepped:
        return
    plan = handle.plan
    groups = (plan.shard_group,) if handle.is_sharded_over_ranks else ()
    ranks = tuple(g for g in (plan.shard_group, plan.replicate_group) if g is not None)
    for param in stepped:
        grad_ready(param, groups, ranks)
    if all(param.grad is None for param in params):
        handle.flat_param.grad = None  # the shard the views' gradients were
