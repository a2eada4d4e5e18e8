"""``_FunctionalRprop``: Rprop with gradients passed in."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from tensorplay.distributed.optim.functional import (
    _FunctionalOptimizer,
    check_nonnegative,
    new_step,
    rprop_step,
    zeros_like,
)

__all__ = ["rprop_step"]


class _FunctionalRprop(_FunctionalOptimizer):
    """Rprop over ``params``; state per parameter: "step", "prev", "step_size" (starts at ``lr``).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalRprop
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalRprop([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.Rprop([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "Rprop"

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-2,
        etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50),
        foreach: bool | None = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, _allow_empty_param_list)
        check_nonnegative(type(self).__name__, lr=lr)
        if not 0.0 < etas[0] < 1.0 < etas[1]:
            raise ValueError(f"{type(self).__name__}: invalid etas={etas}; "
                             "they must satisfy 0 < etaminus < 1 < etaplus")
        self.defaults = {"lr": lr}
        self.etas = etas
        self.step_sizes = step_sizes
        self._set_kernel_path(foreach)
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        lr = self.defaults["lr"]
        fill = complex(lr, lr) if param.is_complex() else lr
        return {"step": new_step(param), "prev": zeros_like(param),
                "step_size": torch.full_like(grad, fill, memory_format=torch.preserve_format)}

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        (etaminus, etaplus), (size_min, size_max) = self.etas, self.step_sizes
        rprop_step(params, grads, [s["prev"] for s in states], [s["step_size"] for s in states],
                   [s["step"] for s in states], step_size_min=size_min, step_size_max=size_max,
                   etaminus=etaminus, etaplus=etaplus, maximize=self.maximize, foreach=self.foreach)
