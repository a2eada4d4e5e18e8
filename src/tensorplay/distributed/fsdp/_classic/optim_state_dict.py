"""Optimizer state dicts of classic FSDP models (WIP)."""

from __future__ import annotations

from ..api import FullOptimStateDictConfig, OptimStateDictConfig, ShardedOptimStateDictConfig, StateDictType, LocalOptimStateDictConfig


def default_config(state_dict_type: StateDictType) -> OptimStateDictConfig:
    return {StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
            StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig,
            StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig}[state_dict_type]()
