"""``_FunctionalAdamW``: Adam with decoupled weight decay, gradients passed in."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from tensorplay.distributed.optim.functional import adam_step
from tensorplay.distributed.optim.functional_adam import _FunctionalAdam

__all__ = ["adam_step"]


class _FunctionalAdamW(_FunctionalAdam):
    """AdamW over ``params``: the parameter decays by ``lr * weight_decay`` before the Adam update.

    Same state as :class:`_FunctionalAdam`; ``adam_step(..., decoupled_weight_decay=True)`` is its update.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _FunctionalAdamW
        >>> weight = tp.nn.Parameter(tp.ones(3))
        >>> optimizer = _FunctionalAdamW([weight], lr=0.1)
        >>> optimizer.step([tp.full((3,), 0.5)])          # gradients passed in, one per parameter
        >>> reference = tp.nn.Parameter(tp.ones(3))
        >>> reference.grad = tp.full((3,), 0.5)
        >>> tp.optim.AdamW([reference], lr=0.1).step()        # the class optimizer takes the same step
        >>> tp.equal(weight, reference)
        True
    """

    _optimizer_name = "AdamW"
    _decoupled_weight_decay = True

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = False,
        fused: bool | None = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused,
                         _allow_empty_param_list)
