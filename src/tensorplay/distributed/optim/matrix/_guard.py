"""Refuse ``torch.optim.Muon`` / ``Adafactor`` built the usual way on our ``fully_shard``'s sharded parameters.

They would compute on each rank's piece of every matrix: PyTorch's Muon then silently
orthogonalises the wrong matrices and its Adafactor fails deep in sharding propagation.
A global optimizer step pre-hook (installed when ``tensorplay.distributed.optim`` is
imported) raises instead, naming the parameter and :class:`ShardedMatrixOptimizer`.
It only looks at optimizers of those two classes, once per optimizer, and only at
parameters our ``fully_shard`` registered (PyTorch's own ``fully_shard`` is left as it is).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

_CHECKED = "_tensorplay_whole_matrix_checked"


def refuse_sharded_pieces(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook: raise if a whole-matrix optimizer holds pieces of matrices sharded by our ``fully_shard``."""
    if not isinstance(optimizer, torch.optim.Muon | torch.optim.Adafactor) or optimizer.__dict__.get(_CHECKED):
        return
    for g, group in enumerate(optimizer.param_groups):
        names = group.get("param_names") or [f"param_groups[{g}][{i}]" for i in range(len(group["params"]))]
        for name, param in zip(names, group["params"], strict=True):
            if _sharded_by_fully_shard(param):
                raise RuntimeError(
                    f"{type(optimizer).__name__} needs whole matrices, but parameter {name!r} (shape "
                    f"{tuple(param.shape)}, placements {param.placements}) is sharded by fully_shard: each rank "
                    f"would update its own piece as if it were the matrix. Construct it through "
                    f"tensorplay.distributed.optim.ShardedMatrixOptimizer(torch.optim.{type(optimizer).__name__}, "
                    "params, **kwargs), which updates each whole matrix on one rank")
    optimizer.__dict__[_CHECKED] = True


def _sharded_by_fully_shard(param: torch.Tensor) -> bool:
    return (isinstance(param, DTensor) and hasattr(param, "_fsdp_owner")
            and any(not placement.is_replicate() for placement in param.placements))


register_optimizer_step_pre_hook(refuse_sharded_pieces)
