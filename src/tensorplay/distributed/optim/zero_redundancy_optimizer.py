"""PyTorch's module path ``optim.zero_redundancy_optimizer``, kept as a thin module of ours: ZeRO lives in
``optim/zero/``."""

from tensorplay.distributed.optim.zero import ZeroRedundancyOptimizer
from tensorplay.distributed.optim.zero import _broadcast_object as _broadcast_object  # PyTorch's private name, used

__all__ = ["ZeroRedundancyOptimizer"]
