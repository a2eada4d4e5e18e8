"""PyTorch's FSDP classes that ours list as bases or twins, for type identity only ([Note: type identity only]).

The one place under ``tensorplay.distributed.fsdp`` that imports
``torch.distributed.fsdp``: nothing here is re-exported or called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    )
    from torch.distributed.fsdp._fully_shard._fsdp_api import DataParallelMeshDims


__all__ = [
    "BackwardPrefetch", "CPUOffload", "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule",
    "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel", "LocalOptimStateDictConfig",
    "LocalStateDictConfig", "MixedPrecision", "MixedPrecisionPolicy", "OffloadPolicy", "OptimStateDictConfig",
    "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
    "StateDictConfig", "StateDictSettings", "StateDictType",
]
