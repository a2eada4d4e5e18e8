"""Model and optimizer state dicts keyed by FQN, whatever the parallelism: PyTorch's helpers (for now)."""

from __future__ import annotations

from torch.distributed.checkpoint.state_dict import (DictValueType, FQNS_T, ListDictValueType, OptimizerStateType,
                                                     PrimitiveType, StateDictOptions, ValueType, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

__all__ = ["FQNS_T", "PrimitiveType", "ValueType", "DictValueType", "ListDictValueType", "OptimizerStateType",
           "StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]
