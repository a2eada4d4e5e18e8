"""``_FunctionalAdadelta``: Adadelta with gradients passed in."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from tensorplay.distributed.optim.functional import (
    _FunctionalOptimizer,
    adadelta_step,
    check_nonnegative,
    check_range,
    new_step,
    zeros_like,
)

__all__ = ["adadelta_step"]


class _FunctionalAdadelta(_FunctionalOptimizer):
    """Adadelta over ``params``; state per parameter: "step", "square_avg", "acc_delta".

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalAdadelta
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalAdadelta([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.Adadelta([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "Adadelta"

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        foreach: bool | None = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, _allow_empty_param_list)
        check_nonnegative(type(self).__name__, lr=lr, eps=eps, weight_decay=weight_decay)
        check_range("rho", rho, 0.0, 1.0, owner=type(self).__name__, include_high=True)
        self.defaults = {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay}
        self._set_kernel_path(foreach)
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        return {"step": new_step(param), "square_avg": zeros_like(param), "acc_delta": zeros_like(param)}

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        d = self.defaults
        adadelta_step(params, grads, [s["square_avg"] for s in states], [s["acc_delta"] for s in states],
                      [s["step"] for s in states], lr=d["lr"], rho=d["rho"], eps=d["eps"],
                      weight_decay=d["weight_decay"], maximize=self.maximize, foreach=self.foreach)
