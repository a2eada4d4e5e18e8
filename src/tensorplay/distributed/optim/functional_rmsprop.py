"""``_FunctionalRMSprop``: RMSprop (momentum, centered) with gradients passed in."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from tensorplay.distributed.optim.functional import (
    _FunctionalOptimizer,
    check_nonnegative,
    new_step,
    rmsprop_step,
    zeros_like,
)

__all__ = ["rmsprop_step"]


class _FunctionalRMSprop(_FunctionalOptimizer):
    """RMSprop over ``params``; state per parameter: "step", "square_avg"
    (+ "momentum_buffer" with momentum > 0, + "grad_avg" when centered).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalRMSprop
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalRMSprop([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.RMSprop([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "RMSprop"

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        foreach: bool | None = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, _allow_empty_param_list)
        check_nonnegative(type(self).__name__, lr=lr, eps=eps, momentum=momentum, weight_decay=weight_decay,
                          alpha=alpha)
        self.defaults = {"lr": lr, "alpha": alpha, "eps": eps, "weight_decay": weight_decay,
                         "momentum": momentum}
        self.centered = centered
        self._set_kernel_path(foreach)
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        state = {"step": new_step(param), "square_avg": zeros_like(param)}
        if self.defaults["momentum"] > 0:
            state["momentum_buffer"] = zeros_like(param)
        if self.centered:
            state["grad_avg"] = zeros_like(param)
        return state

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        d = self.defaults
        with_momentum = d["momentum"] > 0
        rmsprop_step(
            params, grads, [s["square_avg"] for s in states],
            [s["grad_avg"] for s in states] if self.centered else [],
            [s["momentum_buffer"] for s in states] if with_momentum else [], [s["step"] for s in states],
            lr=d["lr"], alpha=d["alpha"], eps=d["eps"], weight_decay=d["weight_decay"], momentum=d["momentum"],
            centered=self.centered, maximize=self.maximize, foreach=self.foreach,
        )
