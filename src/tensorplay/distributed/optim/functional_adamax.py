"""``_FunctionalAdamax``: Adamax with gradients passed in."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from tensorplay.distributed.optim._functional_base import (
    _FunctionalOptimizer, check_range, new_step, zeros_like,
)
from tensorplay.distributed.optim._updates import adamax_step

__all__ = ["adamax_step"]


class _FunctionalAdamax(_FunctionalOptimizer):
    """Adamax over ``params``; state per parameter: "step", "exp_avg", "exp_inf"."""

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
        owner = type(self).__name__
        check_range("lr", lr, 0.0, owner=owner)
        check_range("eps", eps, 0.0, owner=owner)
        check_range("betas[0]", betas[0], 0.0, 1.0, owner=owner)
        check_range("betas[1]", betas[1], 0.0, 1.0, owner=owner)
        check_range("weight_decay", weight_decay, 0.0, owner=owner)
        self.defaults = {"lr": lr, "eps": eps, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay}
        self.foreach = bool(foreach)
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        return {"step": new_step(param), "exp_avg": zeros_like(param), "exp_inf": zeros_like(param)}

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        d = self.defaults
        adamax_step(params, grads, [s["exp_avg"] for s in states], [s["exp_inf"] for s in states],
                    [s["step"] for s in states], lr=d["lr"], beta1=d["beta1"], beta2=d["beta2"], eps=d["eps"],
                    weight_decay=d["weight_decay"], maximize=self.maximize, foreach=self.foreach)
