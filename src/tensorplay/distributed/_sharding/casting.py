"""Casting the floating-point tensors of a nested structure (mixed precision's inputs and outputs)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


def cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (other leaves unchanged)."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    return tree_map(cast, tree)
