"""What an optimizer stepped inside backward does besides stepping: accumulation and global-norm clipping.

    options = InBackwardOptions(accumulation_steps=4, max_norm=1.0, clip_mode="exact")
    apply_optimizer_in_backward(tp.optim.AdamW, model.parameters(), {"lr": 1e-3}, options=options)

[Note: the two clipping modes and their memory price]
Clipping by the global norm needs every gradient before any parameter steps,
which is what stepping in backward avoids. The mode is therefore an explicit
choice (``max_norm`` without ``clip_mode`` is an error):

* ``"exact"``: each (sharded) gradient is kept, not freed, until the end of
  backward; then one small all-reduce gives the global norm and every parameter
  steps on its clipped gradient. Equal to ``clip_grad_norm_`` + ``step``. The
  memory saved over stepping after backward is the *unsharded* gradients
  (fully_shard already frees those); the sharded gradients all exist at once.
  Under DDP the kept gradients are slices of its persistent buckets, so
  nothing is added (nor saved: DDP's buckets hold every gradient anyway).
* ``"previous"``: each parameter steps and frees its gradient at once, clipped
  with the global norm of the *previous* optimizer step (the norm of this step
  is summed as the gradients pass and all-reduced once at the end of backward).
  The first step has no previous norm and runs as ``"exact"``. Nothing is kept.
  The clipped update differs from the exact one by ``|c_prev - c| * ||g||``
  (``c = min(1, max_norm / (||g|| + 1e-6))``, ``c_prev`` the same with the
  previous norm), per step, in the norm of the whole update direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tensorplay.distributed._checks.validation import check_int, check_real

__all__ = ["CLIP_MODES", "InBackwardOptions"]

CLIP_MODES = ("exact", "previous")
_WHERE = "InBackwardOptions"


@dataclass(frozen=True)
class InBackwardOptions:
    """Accumulation and clipping for the optimizers of one ``apply_optimizer_in_backward`` call.

    Args:
        accumulation_steps: the optimizer steps in every ``accumulation_steps``-th
            backward that delivers the parameter's (reduced) gradient; the others
            accumulate into ``.grad``. Under a front end's ``no_sync()`` /
            ``set_requires_gradient_sync(False)`` only the synchronizing backward
            delivers a gradient, so keep 1 there: the step then happens in the
            backward of the last micro-batch. Checked equal on every rank.
        max_norm: clip the global gradient norm (over this call's parameters, on
            every rank) to this value; ``None`` does not clip.
        clip_mode: ``"exact"`` or ``"previous"``, required with ``max_norm``; see
            [Note: the two clipping modes and their memory price].
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
        grad_scaler: a (Sharded)GradScaler whose ``scale(loss)`` the backward
            runs on: gradients are kept until the end of backward (the memory
            price of ``"exact"``), unscaled, checked for inf/nan on every rank
            and stepped only if there is none (no parameter is touched
            otherwise); call ``scaler.update()`` after backward as usual. Not
            with ``"previous"``, which steps before the check could be made.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.apply_optimizer_in_backward import (InBackwardOptions,
        ...                                                                       apply_optimizer_in_backward)
        >>> model = tp.nn.Linear(4, 2)
        >>> options = InBackwardOptions(max_norm=1.0, clip_mode="exact")   # clip by the global norm, then step
        >>> apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1}, options=options)
        >>> model(tp.ones(1, 4)).sum().backward()
        >>> model.weight.grad is None
        True
    """

    accumulation_steps: int = 1
    max_norm: float | None = None
    clip_mode: str | None = None
    norm_type: float = 2.0
    grad_scaler: Any = None

    def __post_init__(self) -> None:
        check_int(self.accumulation_steps, "accumulation_steps", _WHERE, minimum=1)
        if self.max_norm is not None:
            check_real(self.max_norm, "max_norm", _WHERE, above=0.0)
        if self.norm_type != math.inf:
            check_real(self.norm_type, "norm_type", _WHERE, above=0.0)
        if self.clip_mode is not None and self.clip_mode not in CLIP_MODES:
            raise ValueError(f"{_WHERE}: clip_mode must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.max_norm is not None and self.clip_mode is None:
            raise ValueError(f"{_WHERE}: max_norm={self.max_norm!r} needs clip_mode: 'exact' (keeps the sharded "
                             "gradients until the global norm is known, equal to clip_grad_norm_ + step) or "
                             "'previous' (clips with the previous step's norm and frees each gradient at once)")
        if self.grad_scaler is not None and not (hasattr(self.grad_scaler, "unscale_")
                                                 and hasattr(self.grad_scaler, "step")):
            raise TypeError(f"{_WHERE}: grad_scaler must be a GradScaler (ShardedGradScaler), got "
                            f"{type(self.grad_scaler).__name__}")
        if self.grad_scaler is not None and self.clip_mode == "previous":
            raise ValueError(f"{_WHERE}: grad_scaler needs every gradient checked for inf/nan before any step; "
                             "clip_mode='previous' steps each at once: use clip_mode='exact' or no clipping")
        if self.clip_mode is not None and self.max_norm is None:
            raise ValueError(f"{_WHERE}: clip_mode={self.clip_mode!r} needs max_norm (the norm to clip to)")

    @property
    def is_default(self) -> bool:
        """True when the options do nothing beyond stepping once per backward."""
        return self.accumulation_steps == 1 and self.max_norm is None and self.grad_scaler is None

    @property
    def keeps_gradients(self) -> bool:
        """True when gradients wait for the end of backward (exact clipping, a loss scaler)."""
        return self.clip_mode == "exact" or self.grad_scaler is not None
