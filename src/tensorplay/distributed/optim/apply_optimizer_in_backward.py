"""PyTorch's module path ``optim.apply_optimizer_in_backward``, kept as a thin module of ours: optimizers in
backward live in ``optim/in_backward/``.

PyTorch's package offers this module under its name; the seeds also call a public function of that name
(``from tensorplay.distributed.optim import apply_optimizer_in_backward``). So both are one object: this
module is callable, and calling it is calling :func:`apply_optimizer_in_backward` (no name shadows the other).
"""

import inspect
import sys
import types
from typing import Any

from tensorplay.distributed.optim.in_backward import (
    InBackwardOptions,
    _apply_optimizer_in_backward,
    _get_in_backward_optimizers,
    apply_optimizer_in_backward,
    grad_ready,
)

__all__ = ["InBackwardOptions", "_apply_optimizer_in_backward", "_get_in_backward_optimizers",
           "apply_optimizer_in_backward", "grad_ready"]


class _CallableModule(types.ModuleType):
    """This module, callable as the function it is named after."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return _apply_optimizer_in_backward(*args, **kwargs)


__signature__ = inspect.signature(_apply_optimizer_in_backward)
sys.modules[__name__].__class__ = _CallableModule
