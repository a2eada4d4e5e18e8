"""What the functional optimizers (``functional_*.py``, PyTorch's paths) are built from: the shared base class
and its argument checks (``_base.py``), the per-optimizer updates over lists of tensors (``_updates.py`` on
``_list_ops.py``) and their TorchScript forms (``_script_updates.py``)."""

from ._base import _FunctionalOptimizer, check_betas, check_fused, check_nonnegative, check_range, new_step, zeros_like
from ._script_updates import ScriptAdam, ScriptSGD
from ._updates import (
    adadelta_step,
    adagrad_step,
    adam_step,
    adamax_step,
    rmsprop_step,
    rprop_step,
    sgd_step,
)

__all__ = ["ScriptAdam", "ScriptSGD", "_FunctionalOptimizer", "adadelta_step", "adagrad_step", "adam_step",
           "adamax_step", "check_betas", "check_fused", "check_nonnegative", "check_range", "new_step",
           "rmsprop_step", "rprop_step", "sgd_step", "zeros_like"]
