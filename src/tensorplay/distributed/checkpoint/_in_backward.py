"""Checkpointing optimizers applied in backward: one optimizer per parameter, with options.

    model_sd, optim_sd = get_state_dict(model, _get_in_backward_optimizers(model))

Two things make them differ from one plain optimizer:

* classic FSDP reads and loads the optimizer state of a whole unit at once,
  for one optimizer: the per-parameter optimizers are read and loaded as one
  (:class:`MergedOptimizers`), their param groups side by side;
* PyTorch's state-dict helpers create a fresh optimizer's state with a template
  step (zero gradients, lr 0), which ``InBackwardOptions`` refuse (these
  optimizers are stepped by backward): :func:`allows_template_steps` lets it
  through for the duration of the call.

``"previous"`` clipping keeps the last step's norm in each optimizer's param
groups (``LAST_NORM_KEY``), so it is saved and loaded with them.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tensorplay.distributed.optim.in_backward import direct_steps

__all__ = ["MergedOptimizers", "allows_template_steps", "merged_if_in_backward"]

F = TypeVar("F", bound=Callable[..., Any])


def allows_template_steps(fn: F) -> F:
    """Run ``fn(model, optimizers, ...)`` with the in-backward optimizers among ``optimizers`` steppable."""

    @functools.wraps(fn)
    def wrapper(model: Any, optimizers: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(optimizers, torch.optim.Optimizer):
            optimizers = tuple(optimizers)  # read twice below
        with direct_steps((optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else optimizers):
            return fn(model, optimizers, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def merged_if_in_backward(optimizers: list[Any]) -> torch.optim.Optimizer | None:
    """One optimizer standing for ``optimizers`` when they are several in-backward optimizers, else None."""
    if len(optimizers) > 1 and all(_in_backward(optimizer) for optimizer in optimizers):
        return MergedOptimizers(optimizers)
    return None


def _in_backward(optimizer: Any) -> bool:
    params = [param for group in getattr(optimizer, "param_groups", ()) for param in group["params"]]
    return bool(params) and all(any(owner is optimizer for owner in getattr(param, "_in_backward_optimizers", ()))
                                for param in params)


class MergedOptimizers(torch.optim.Optimizer):
    """Several optimizers read as one: their param groups (the same dicts) in order, the union of their
    states; ``step`` steps each, ``load_state_dict`` hands each its groups and their state."""

    _steps_in_backward = True  # not a plain optimizer over in-backward parameters

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self._optimizers = optimizers
        self.param_groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        self._refresh_state()

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for optimizer in self._optimizers:
            optimizer.step()
        self._refresh_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state, groups, start = state_dict["state"], state_dict["param_groups"], 0
        for optimizer in self._optimizers:
            mine, start = groups[start:start + len(optimizer.param_groups)], start + len(optimizer.param_groups)
            indices = [index for group in mine for index in group["params"]]
            local = {index: position for position, index in enumerate(indices)}
            optimizer.load_state_dict({
                "state": {local[index]: state[index] for index in indices if index in state},
                "param_groups": [{**group, "params": [local[i] for i in group["params"]]} for group in mine]})
        self._refresh_state()

    def _refresh_state(self) -> None:
        self.state = defaultdict(dict, {p: s for o in self._optimizers for p, s in o.state.items()})
