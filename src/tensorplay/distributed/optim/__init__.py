"""Distributed optimizers: ZeRO (``zero/``), post-local SGD, the RPC DistributedOptimizer,
and the functional optimizers (``_FunctionalAdam`` ...) that communication hooks
and :func:`apply_optimizer_in_backward` step with gradients passed in
(:func:`as_functional_optim` maps a ``tp.optim`` class to its functional form),
and ``_NamedOptimizer`` (an optimizer whose state dict is keyed by parameter FQN); the whole-matrix
optimizers (``matrix/``), optimizers applied in backward (``in_backward/``) and what the functional optimizers
are built from (``functional/``). PyTorch's module paths (``zero_redundancy_optimizer.py``,
``apply_optimizer_in_backward.py`` ...) are kept, re-exporting from those sub-packages.
"""

# The module itself is the public function too (it is callable; see its docstring): binding the function here
# would shadow the module PyTorch's path names.
import tensorplay.distributed.optim.apply_optimizer_in_backward as apply_optimizer_in_backward
from tensorplay.distributed.optim.functional_adadelta import _FunctionalAdadelta
from tensorplay.distributed.optim.functional_adagrad import _FunctionalAdagrad
from tensorplay.distributed.optim.functional_adam import _FunctionalAdam
from tensorplay.distributed.optim.functional_adamax import _FunctionalAdamax
from tensorplay.distributed.optim.functional_adamw import _FunctionalAdamW
from tensorplay.distributed.optim.functional_rmsprop import _FunctionalRMSprop
from tensorplay.distributed.optim.functional_rprop import _FunctionalRprop
from tensorplay.distributed.optim.functional_sgd import _FunctionalSGD
from tensorplay.distributed.optim.in_backward import _apply_optimizer_in_backward, _get_in_backward_optimizers
from tensorplay.distributed.optim.named_optimizer import _NamedOptimizer
from tensorplay.distributed.optim.optimizer import DistributedOptimizer
from tensorplay.distributed.optim.post_localSGD_optimizer import PostLocalSGDOptimizer
from tensorplay.distributed.optim.sharded_matrix import ShardedMatrixOptimizer as ShardedMatrixOptimizer
from tensorplay.distributed.optim.utils import as_functional_optim
from tensorplay.distributed.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = [
    "_FunctionalAdadelta",
    "_FunctionalAdagrad",
    "_FunctionalAdam",
    "_FunctionalAdamW",
    "_FunctionalAdamax",
    "_FunctionalRMSprop",
    "_FunctionalRprop",
    "_FunctionalSGD",
    "_NamedOptimizer",
    "_apply_optimizer_in_backward",
    "_get_in_backward_optimizers",
    "apply_optimizer_in_backward",
    "as_functional_optim",
    "DistributedOptimizer",
    "PostLocalSGDOptimizer",
    "ShardedMatrixOptimizer",
    "ZeroRedundancyOptimizer",
]
