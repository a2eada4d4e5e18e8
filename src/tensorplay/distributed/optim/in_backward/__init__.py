"""Optimizers applied in backward: each parameter stepped as soon as its gradient is final.

``_apply.py`` attaches the optimizers (``apply_optimizer_in_backward``), ``_group.py`` runs one call's
parameters through accumulation and clipping (``_options.py``, ``_clip.py``). The front ends hand gradients
over through the "gradient ready" hook point (``_sharding/grad_ready.py``), never by importing this package.
"""

from ._apply import (
    _apply_optimizer_in_backward,
    _get_in_backward_optimizers,
    apply_optimizer_in_backward,
    grad_ready,
    remove_post_accumulate_hook,
)
from ._group import direct_steps
from ._options import InBackwardOptions

__all__ = ["InBackwardOptions", "_apply_optimizer_in_backward", "_get_in_backward_optimizers",
           "apply_optimizer_in_backward", "direct_steps", "grad_ready", "remove_post_accumulate_hook"]
