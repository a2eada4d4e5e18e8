"""Step a functional optimizer on each DDP bucket as soon as its gradients are reduced.

    from tensorplay.distributed.optim import as_functional_optim
    from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state = _OptimizerHookState(as_functional_optim(tp.optim.Adam, lr=1e-3))
    ddp_model.register_comm_hook(None, _hook_then_optimizer(allreduce_hook, state))
    loss.backward()   # each bucket: all-reduce, then the optimizer step on its parameters

The optimizer step of one bucket overlaps the communication of the next, and no
separate ``optimizer.step()`` follows backward.

Differences from PyTorch's ``_hook_then_optimizer``, each to avoid a silent
wrong result or lost speed:

* a failed communication future fails the step; PyTorch's steps anyway, on
  un-reduced gradients;
* when the wrapped hook resolves to a tensor other than the bucket's buffer, that
  result is copied into the buffer before the step (PyTorch's steps on the buffer
  as it was);
* an optimizer offering ``step_params`` (ours do) steps the whole bucket at
  once, so ``foreach=True`` runs one multi-tensor kernel per bucket.

DDP compares hook annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so this module keeps real annotations
(no ``from __future__ import annotations``).
"""

from typing import Any, Callable, Iterable, Optional

import torch

import tensorplay.distributed as dist

__all__: list = []

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

_STEP_METHOD = "step_param"


class _OptimizerHookState:
    """A functional optimizer (anything with ``step_param(param, grad)``) and, optionally,
    the parameters it owns: others in a bucket are reduced but not stepped by the hook."""

    __slots__ = ("functional_optimizer", "params_to_optimize")

    def __init__(self, functional_optim: Any, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        if not hasattr(functional_optim, _STEP_METHOD):
            raise ValueError(
                f"{type(functional_optim).__name__} has no {_STEP_METHOD}(param, grad) method, so it cannot step "
                "inside a DDP hook; build one with tensorplay.distributed.optim.as_functional_optim(<optim class>, "
                "...)")
        self.functional_optimizer = functional_optim
        self.params_to_optimize = set(params) if params is not None else None


def _hook_then_optimizer(hook: Hook, optimizer_state: _OptimizerHookState) -> Hook:
    """Wrap ``hook`` so that, once its future resolves, the bucket's parameters take an optimizer step."""

    def hook_then_optimizer_wrapper(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        communicated = hook(hook_state, bucket)

        def step_bucket(fut: torch.futures.Future[Any]) -> torch.Tensor:
            buffer = bucket.buffer()
            _adopt_result(buffer, fut.value())  # .value() re-raises a failed communication
            _step(optimizer_state, bucket.parameters(), bucket.gradients())
            return buffer

        return communicated.then(step_bucket)

    return hook_then_optimizer_wrapper


def _adopt_result(buffer: torch.Tensor, result: Any) -> None:
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    if isinstance(result, torch.Tensor) and result.data_ptr() != buffer.data_ptr():
        buffer.copy_(result.view_as(buffer))


def _step(state: _OptimizerHookState, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    if state.params_to_optimize is not None:
        chosen = [(p, g) for p, g in zip(params, grads) if p in state.params_to_optimize]
        params, grads = [p for p, _ in chosen], [g for _, g in chosen]
    optimizer = state.functional_optimizer
    if hasattr(optimizer, "step_params"):
        optimizer.step_params(params, grads)
        return
    for param, grad in zip(params, grads):
        optimizer.step_param(param, grad)
