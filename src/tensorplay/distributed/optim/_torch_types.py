"""PyTorch's optimizer wrappers that ours list as bases, for type identity only ([Note: type identity only]).

The one place under ``tensorplay.distributed.optim`` that imports
``torch.distributed.optim``: nothing here is re-exported or called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # bases for isinstance only: mypy must not hold our signatures to theirs
    PostLocalSGDOptimizer: Any
    ZeroRedundancyOptimizer: Any
else:
    from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer


__all__ = ["PostLocalSGDOptimizer", "ZeroRedundancyOptimizer"]
