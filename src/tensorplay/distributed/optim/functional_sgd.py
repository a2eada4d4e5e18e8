"""``_FunctionalSGD``: SGD (momentum, dampening, Nesterov) with gradients passed in."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from tensorplay.distributed.optim.functional import (
    ScriptSGD,
    _FunctionalOptimizer,
    check_fused,
    check_nonnegative,
    sgd_step,
)

__all__ = ["sgd_step"]


class _FunctionalSGD(_FunctionalOptimizer):
    """SGD over ``params``; with momentum, state per parameter: "momentum_buffer" (after its first step).

    Sparse gradients are accepted (not with ``fused=True``). Unlike PyTorch's,
    ``step_param(p, None)`` is a no-op rather than an IndexError.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalSGD
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalSGD([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.SGD([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "SGD"

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-2,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        foreach: bool | None = False,
        fused: bool | None = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, _allow_empty_param_list)
        check_nonnegative(type(self).__name__, lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{type(self).__name__}: nesterov=True needs momentum > 0 and dampening=0, got "
                             f"momentum={momentum}, dampening={dampening}")
        self._set_kernel_path(foreach, fused)
        self.defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay}
        self.nesterov = nesterov
        self.maximize = maximize

    def _sparse_refusal(self) -> str | None:
        return "fused=True does not support sparse gradients" if self.fused else None

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        if self.fused:
            check_fused([param], type(self).__name__)
        return {}  # the momentum buffer is the first (processed) gradient, set by the step

    def _script_update(self) -> torch.nn.Module | None:
        d = self._float_defaults()
        if self.foreach or self.fused or d is None:
            return None
        return ScriptSGD(self.param_group["params"], d["lr"], d["momentum"], d["dampening"], d["weight_decay"],
                         self.nesterov, self.maximize)

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        d = self.defaults
        buffers: list[Tensor | None] = [s.get("momentum_buffer") for s in states]
        sgd_step(params, grads, buffers, lr=d["lr"], momentum=d["momentum"], dampening=d["dampening"],
                 weight_decay=d["weight_decay"], nesterov=self.nesterov, maximize=self.maximize,
                 foreach=self.foreach, fused=self.fused)
        if d["momentum"] != 0:
            for state, buf in zip(states, buffers, strict=True):
                assert buf is not None  # sgd_step fills every buffer when momentum is on
                state["momentum_buffer"] = buf
