"""The classic wrapper's home module under PyTorch's path: a re-export of our objects.

Code written for PyTorch imports these names from this module (e.g.
``from ...fsdp.fully_sharded_data_parallel import FullyShardedDataParallel,
FullStateDictConfig, StateDictType``); every object here is the one defined in
this package.
"""

from __future__ import annotations

from ._classic.fully_sharded_data_parallel import FullyShardedDataParallel
from ._classic.param_views import FLAT_PARAM
from ._classic.sharding_plan import HYBRID_STRATEGIES

# ruff: noqa: F401  (re-exports: PyTorch's module keeps only two names in __all__, users import the others too)
from ._classic.unit_state import WRAPPED as FSDP_WRAPPED_MODULE
from ._classic.unit_state import TrainingState
from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .wrap import CustomPolicy, ModuleWrapPolicy

FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
HYBRID_SHARDING_STRATEGIES = list(HYBRID_STRATEGIES)

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]
