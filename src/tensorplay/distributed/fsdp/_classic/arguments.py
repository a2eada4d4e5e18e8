"""FullyShardedDataParallel's argument checks, run before the constructor changes anything.

Each failure is a TypeError/ValueError naming the argument and its value (see
``tensorplay.distributed._checks.validation``); a rejected construction leaves
the module, its parameters and its hooks as they were.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tensorplay.distributed import ProcessGroup

from ..._checks.validation import (
    check_bool,
    check_callable,
    check_enum,
    check_instance,
    check_int,
    check_iterable,
    check_process_group,
)
from ..api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)

_WHERE = "FullyShardedDataParallel"


def check_fsdp_args(module: Any, process_group: Any, sharding_strategy: Any, cpu_offload: Any,
                    auto_wrap_policy: Any, backward_prefetch: Any, mixed_precision: Any, ignored_modules: Any,
                    param_init_fn: Any, device_id: Any, flags: dict[str, Any], ignored_states: Any,
                    device_mesh: Any) -> None:
    """``flags``: the bool arguments by name (sync_module_states, forward_prefetch, ...)."""
    check_instance(module, nn.Module, "module", _WHERE)
    _check_process_group(process_group)
    check_enum(sharding_strategy, ShardingStrategy, "sharding_strategy", _WHERE, optional=True)
    check_instance(cpu_offload, CPUOffload, "cpu_offload", _WHERE, optional=True,
                   hint="e.g. CPUOffload(offload_params=True)")
    check_callable(auto_wrap_policy, "auto_wrap_policy", _WHERE)
    check_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch", _WHERE, optional=True)
    check_instance(mixed_precision, MixedPrecision, "mixed_precision", _WHERE, optional=True,
                   hint="e.g. MixedPrecision(param_dtype=tp.bfloat16)")
    check_iterable(ignored_modules, "ignored_modules", _WHERE)
    check_iterable(ignored_states, "ignored_states", _WHERE)
    check_callable(param_init_fn, "param_init_fn", _WHERE)
    _check_device_id(device_id)
    for name, value in flags.items():
        check_bool(value, name, _WHERE)
    check_instance(device_mesh, DeviceMesh, "device_mesh", _WHERE, optional=True)


def _check_process_group(process_group: Any) -> None:
    if isinstance(process_group, tuple):
        for index, group in enumerate(process_group):
            check_instance(group, ProcessGroup, f"process_group[{index}]", _WHERE)
        return
    check_process_group(process_group, "process_group", _WHERE)


def _check_device_id(device_id: Any) -> None:
    if device_id is None or isinstance(device_id, torch.device):
        return
    if isinstance(device_id, str):
        try:
            torch.device(device_id)
        except RuntimeError:
            raise ValueError(f"{_WHERE}: device_id must name a device (e.g. 'cuda:0' or 'cpu'), got "
                             f"{device_id!r}") from None
        return
    try:
        check_int(device_id, "device_id", _WHERE, minimum=0)
    except TypeError:
        raise TypeError(f"{_WHERE}: device_id must be an int, a torch.device or None, got {device_id!r} "
                        f"({type(device_id).__name__})") from None


def check_state_dict_type_args(module: Any, state_dict_type: Any, state_dict_config: Any,
                               optim_state_dict_config: Any) -> None:
    """``set_state_dict_type`` / ``state_dict_type``: the module, the enum member and the config types."""
    where = "FullyShardedDataParallel.set_state_dict_type"
    check_instance(module, nn.Module, "module", where)
    check_enum(state_dict_type, StateDictType, "state_dict_type", where)
    check_instance(state_dict_config, StateDictConfig, "state_dict_config", where, optional=True,
                   hint="e.g. FullStateDictConfig(rank0_only=True)")
    check_instance(optim_state_dict_config, OptimStateDictConfig, "optim_state_dict_config", where, optional=True,
                   hint="e.g. FullOptimStateDictConfig(rank0_only=True)")
