"""PyTorch's FSDP classes that ours list as bases or twins, for type identity only ([Note: type identity only]).

The one place under ``tensorplay.distributed.fsdp`` that imports
``torch.distributed.fsdp``: nothing here is re-exported or called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed._composable.contract import STATE_KEY

if TYPE_CHECKING:  # bases for isinstance only: mypy must not hold our signatures to theirs
    BackwardPrefetch: Any
    CPUOffload: Any
    CPUOffloadPolicy: Any
    FSDPModule: Any
    FullOptimStateDictConfig: Any
    FullStateDictConfig: Any
    FullyShardedDataParallel: Any
    LocalOptimStateDictConfig: Any
    LocalStateDictConfig: Any
    MixedPrecision: Any
    MixedPrecisionPolicy: Any
    OffloadPolicy: Any
    OptimStateDictConfig: Any
    OptimStateKeyType: Any
    ShardedOptimStateDictConfig: Any
    ShardedStateDictConfig: Any
    ShardingStrategy: Any
    StateDictConfig: Any
    StateDictSettings: Any
    StateDictType: Any
    DataParallelMeshDims: Any
    fully_shard: Any
else:
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        CPUOffloadPolicy,
        FSDPModule,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        MixedPrecisionPolicy,
        OffloadPolicy,
        OptimStateDictConfig,
        OptimStateKeyType,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictConfig,
        StateDictSettings,
        StateDictType,
        fully_shard,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_api import DataParallelMeshDims


__all__ = [
    "BackwardPrefetch", "CPUOffload", "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule",
    "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel", "LocalOptimStateDictConfig",
    "LocalStateDictConfig", "MixedPrecision", "MixedPrecisionPolicy", "OffloadPolicy", "OptimStateDictConfig",
    "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
    "StateDictConfig", "StateDictSettings", "StateDictType", "expose_state", "is_torch_fsdp_module",
    "mark_flat_param",
]


def expose_state(module: nn.Module, state: object) -> None:
    """PyTorch's ``fully_shard.state(module)`` returns our ``state`` too: pipelining asks it for the state."""
    module.__dict__.setdefault(STATE_KEY, {})[fully_shard.__wrapped__] = state


def mark_flat_param(param: nn.Parameter) -> None:
    """``isinstance(param, FlatParameter)`` holds (PyTorch's class checks this flag): PyTorch's helpers then map a
    classic unit's flat parameter to the FQNs it holds (``param._fqns``), as they map PyTorch's."""
    param._is_flat_param = True  # type: ignore[attr-defined]


def is_torch_fsdp_module(name: str) -> bool:
    """Whether the module called ``name`` is inside PyTorch's FSDP package (to word an error naming its helper)."""
    package = FullyShardedDataParallel.__module__.rpartition(".")[0]
    return name == package or name.startswith(package + ".")
