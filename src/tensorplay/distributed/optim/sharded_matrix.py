"""``ShardedMatrixOptimizer``'s path: the whole-matrix optimizers live in ``optim/matrix/``."""

from tensorplay.distributed.optim.matrix import ShardedMatrixOptimizer

__all__ = ["ShardedMatrixOptimizer"]
