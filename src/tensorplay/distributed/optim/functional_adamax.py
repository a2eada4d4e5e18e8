"""``_FunctionalAdamax``: Adamax with gradients passed in."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from tensorplay.distributed.optim.functional import (
    _FunctionalOptimizer,
    adamax_step,
    check_betas,
    check_nonnegative,
    new_step,
    zeros_like,
)

__all__ = ["adamax_step"]


class _FunctionalAdamax(_FunctionalOptimizer):
    """Adamax over ``params``; state per parameter: "step", "exp_avg", "exp_inf".

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalAdamax
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalAdamax([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.Adamax([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "Adamax"

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool | None = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, _allow_empty_param_list)
        check_nonnegative(type(self).__name__, lr=lr, eps=eps, weight_decay=weight_decay)
        check_betas(type(self).__name__, betas)
        self.defaults = {"lr": lr, "eps": eps, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay}
        self._set_kernel_path(foreach)
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        return {"step": new_step(param), "exp_avg": zeros_like(param), "exp_inf": zeros_like(param)}

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        d = self.defaults
        adamax_step(params, grads, [s["exp_avg"] for s in states], [s["exp_inf"] for s in states],
                    [s["step"] for s in states], lr=d["lr"], beta1=d["beta1"], beta2=d["beta2"], eps=d["eps"],
                    weight_decay=d["weight_decay"], maximize=self.maximize, foreach=self.foreach)
