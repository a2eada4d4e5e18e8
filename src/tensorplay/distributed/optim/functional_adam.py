"""``_FunctionalAdam``: Adam with gradients passed in (see ``functional/_base.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from tensorplay.distributed.optim.functional import (
    ScriptAdam,
    _FunctionalOptimizer,
    adam_step,
    check_betas,
    check_fused,
    check_nonnegative,
    new_step,
    zeros_like,
)

__all__ = ["adam_step"]


class _FunctionalAdam(_FunctionalOptimizer):
    """Adam over ``params``; state per parameter: "step", "exp_avg", "exp_avg_sq" (+ "max_exp_avg_sq").

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalAdam
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalAdam([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.Adam([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "Adam"
    _decoupled_weight_decay = False

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = False,
        fused: bool | None = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, _allow_empty_param_list)
        check_nonnegative(type(self).__name__, lr=lr, eps=eps, weight_decay=weight_decay)
        check_betas(type(self).__name__, betas)
        self._set_kernel_path(foreach, fused)
        self.defaults = {"lr": lr, "eps": eps, "beta1": betas[0], "beta2": betas[1],
                         "weight_decay": weight_decay}
        self.amsgrad = amsgrad
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        if self.fused:
            check_fused([param], type(self).__name__)
        state = {"step": new_step(param, on_param_device=self.fused),
                 "exp_avg": zeros_like(param), "exp_avg_sq": zeros_like(param)}
        if self.amsgrad:
            state["max_exp_avg_sq"] = zeros_like(param)
        return state

    def _script_update(self) -> torch.nn.Module | None:
        d = self._float_defaults()
        params = self.param_group["params"]
        if self.foreach or self.fused or d is None or any(p.is_complex() for p in params):
            return None  # complex parameters step as real views: the Python step does that
        return ScriptAdam(params, d["lr"], d["beta1"], d["beta2"], d["eps"], d["weight_decay"], self.amsgrad,
                          self.maximize, self._decoupled_weight_decay)

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        d = self.defaults
        adam_step(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if self.amsgrad else [], [s["step"] for s in states],
            lr=d["lr"], beta1=d["beta1"], beta2=d["beta2"], eps=d["eps"], weight_decay=d["weight_decay"],
            amsgrad=self.amsgrad, maximize=self.maximize, decoupled_weight_decay=self._decoupled_weight_decay,
            foreach=self.foreach, fused=self.fused,
        )
