"""``_FunctionalAdagrad``: Adagrad with gradients passed in."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

from tensorplay.distributed.optim.functional import (
    _FunctionalOptimizer,
    adagrad_step,
    check_nonnegative,
    new_step,
)

__all__ = ["adagrad_step"]


class _FunctionalAdagrad(_FunctionalOptimizer):
    """Adagrad over ``params``; state per parameter: "step", "sum" (created for every parameter up front,
    as ``tp.optim.Adagrad`` does, and on first use for one added through ``step_param``).

    Sparse gradients are accepted unless ``weight_decay`` is set or ``fused=True``.
    ``warmup_lr_multiplier``, ``warmup_num_iters`` and ``coalesce_grad`` exist for
    signature compatibility only: PyTorch ignores them silently, we warn when the
    warm-up ones are set.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalAdagrad
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalAdagrad([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.Adagrad([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "Adagrad"

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        warmup_lr_multiplier: float = 1.0,
        warmup_num_iters: float = 0.0,
        eps: float = 1e-10,
        coalesce_grad: bool = True,
        foreach: bool | None = False,
        fused: bool | None = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, _allow_empty_param_list)
        check_nonnegative(type(self).__name__, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                          initial_accumulator_value=initial_accumulator_value, eps=eps)
        if warmup_lr_multiplier != 1.0 or warmup_num_iters != 0.0:
            warnings.warn(f"{type(self).__name__}: warmup_lr_multiplier and warmup_num_iters have no effect "
                          "(as in PyTorch); "
                          "use an LR scheduler for warm-up", stacklevel=2)
        self._set_kernel_path(foreach, fused)
        self.defaults = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
                         "initial_accumulator_value": initial_accumulator_value,
                         "warmup_lr_multiplier": warmup_lr_multiplier, "warmup_num_iters": warmup_num_iters}
        self.coalesce_grad = coalesce_grad
        self.maximize = maximize
        for param in self.param_group["params"]:
            self.state[param] = self._init_state(param, None)

    def _sparse_refusal(self) -> str | None:
        if self.fused:
            return "fused=True does not support sparse gradients"
        if self.defaults["weight_decay"] != 0:
            return f"weight_decay={self.defaults['weight_decay']} does not support sparse gradients"
        return None

    def _init_state(self, param: Tensor, grad: Tensor | None) -> dict[str, Tensor]:
        init = self.defaults["initial_accumulator_value"]
        fill = complex(init, init) if param.is_complex() else init
        return {"step": new_step(param, on_param_device=self.fused),
                "sum": torch.full_like(param, fill, memory_format=torch.preserve_format)}

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        d = self.defaults
        adagrad_step(params, grads, [s["sum"] for s in states], [s["step"] for s in states], lr=d["lr"],
                     lr_decay=d["lr_decay"], weight_decay=d["weight_decay"], eps=d["eps"], maximize=self.maximize,
                     foreach=self.foreach, fused=self.fused)
