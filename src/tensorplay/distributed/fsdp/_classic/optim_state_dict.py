"""Optimizer state dicts of classic FSDP models, keyed by the unwrapped model's parameter FQNs.

The optimizer holds state per flat shard (``use_orig_params=False``) or per
original parameter's piece of a shard (``use_orig_params=True``). Saving lays
each state tensor out like the unit's flat shard, gathers it over the shard
group and cuts it into the original parameters; loading does the reverse. Scalar
state (Adam's ``step``) is the same for every parameter of a unit and copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

import tensorplay.distributed as dist
from tensorplay.distributed._comm import objects
from tensorplay.distributed._sharding.param_entries import ParamEntry
from tensorplay.distributed.tensor import DTensor

from ..api import (
    FullOptimStateDictConfig,
    LocalOptimStateDictConfig,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    StateDictType,
)
from .flat_param import FlatParamHandle
from .param_views import shard_pieces
from .state_dict import _full_tensor, sharded_value
from .unit_state import UnitState, clean_fqn, named_states

State = dict[str, Any]


def default_config(state_dict_type: StateDictType) -> OptimStateDictConfig:
    return {StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
            StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig,
            StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig}[state_dict_type]()


def _units(model: nn.Module) -> Iterator[tuple[str, UnitState]]:
    """``(FQN prefix, unit)`` of every unit of ``model`` holding parameters."""
    for name, unit in named_states(model):
        if unit.handle is not None:
            yield (f"{name}." if name else ""), unit


def param_entries(model: nn.Module) -> dict[int, ParamEntry]:
    """``id(param) -> ParamEntry`` for every parameter an optimizer of ``model`` can hold."""
    entries: dict[int, ParamEntry] = {}
    for prefix, unit in _units(model):
        handle = unit.handle
        assert handle is not None
        fqns = tuple(prefix + slot.fqn for slot in handle.slots)
        if handle.views.per_original():
            for index, param in enumerate(handle.views.registered(handle)):
                entries[id(param)] = ParamEntry((fqns[index],), handle, index)
        else:
            entries[id(handle.flat_param)] = ParamEntry(fqns, handle)
    for name, param in model.named_parameters():
        entries.setdefault(id(param), ParamEntry((clean_fqn(name),)))
    return entries


def _optim_params(optim: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [param for group in optim.param_groups for param in group["params"]]


def _entry(entries: dict[int, ParamEntry], param: torch.Tensor) -> ParamEntry:
    if id(param) not in entries:
        raise ValueError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in the model; "
                         "build the optimizer from this FSDP model's parameters()")
    return entries[id(param)]


# ---- saving ----------------------------------------------------------------------------------------

def _is_sharded_value(value: Any, like: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == like.shape


def _unit_full_state(handle: FlatParamHandle, optim: torch.optim.Optimizer) -> list[State]:
    """Per original parameter of ``handle``: its optimizer state with full tensors (collective)."""
    if handle.views.per_original():
        layouts = _orig_state_layout(handle, optim)
    else:
        state = optim.state.get(handle.flat_param, {})
        layouts = {key: (value if _is_sharded_value(value, handle.flat_param) else _Scalar(value))
                   for key, value in state.items()}
    per_param: list[State] = [{} for _ in handle.slots]
    for key, value in layouts.items():  # tensors first, then scalars, as PyTorch orders them
        if not isinstance(value, _Scalar):
            full = handle.gather_full(value)
            for state, view in zip(per_param, handle.full_views(full), strict=True):
                state[key] = view.clone()
    for key, value in layouts.items():
        if isinstance(value, _Scalar):
            for state in per_param:
                state[key] = value.copy()
    return per_param


@dataclass(frozen=True)
class _Scalar:
    value: Any

    def copy(self) -> Any:
        return self.value.clone() if isinstance(self.value, torch.Tensor) else self.value


def _orig_state_layout(handle: FlatParamHandle, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Each state key of the unit's original parameters as one tensor laid out like the flat shard.

    Ranks whose piece of a parameter is empty hold no state for it, so which keys
    exist (and the scalar values) are agreed over the shard group first.
    """
    originals = handle.views.registered(handle)
    local: dict[str, Any] = {}
    for param in originals:
        for key, value in optim.state.get(param, {}).items():
            local.setdefault(key, ("tensor", value.dtype) if _is_sharded_value(value, param) else _Scalar(value))
    merged: dict[str, Any] = {}
    for described in _gather_objects(local, handle):
        for key, value in described.items():
            merged.setdefault(key, value)
    layouts: dict[str, Any] = {}
    for key, description in merged.items():
        if isinstance(description, _Scalar):
            layouts[key] = description
            continue
        flat = torch.zeros_like(handle.flat_param, dtype=description[1])
        for param, piece in zip(originals, shard_pieces(handle, flat), strict=True):
            value = optim.state.get(param, {}).get(key)
            if value is not None and piece.numel():
                piece.copy_(value.reshape(-1))
        layouts[key] = flat
    return layouts


def _gather_objects(obj: Any, handle: FlatParamHandle) -> list[Any]:
    if not handle.is_sharded_over_ranks:
        return [obj]
    gathered: list[Any] = [None] * handle.plan.shard_size
    objects.all_gather_object(gathered, obj, handle.plan.shard_group, where="optimizer state layouts")
    return gathered


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict[str, State], list[dict[str, Any]]]:
    entries = param_entries(model)
    by_fqn: dict[str, State] = {}
    done: set[int] = set()
    for param in _optim_params(optim):
        entry = _entry(entries, param)
        if entry.handle is None:
            if param in optim.state:
                by_fqn[entry.fqns[0]] = {k: _Scalar(v).copy() for k, v in optim.state[param].items()}
            continue
        if id(entry.handle) in done:
            continue
        done.add(id(entry.handle))
        unit_fqns = [fqn for e in entries.values() if e.handle is entry.handle for fqn in e.fqns]
        for fqn, state in zip(unit_fqns, _unit_full_state(entry.handle, optim), strict=True):
            if state:
                by_fqn[fqn] = state
    order = [fqn for param in _optim_params(optim) for fqn in _entry(entries, param).fqns]
    state = {fqn: by_fqn[fqn] for fqn in order if fqn in by_fqn}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [fqn for param in group["params"] for fqn in _entry(entries, param).fqns]}
              for group in optim.param_groups]
    return state, groups


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool = True,
                          offload_to_cpu: bool = True) -> dict[str, Any]:
    state, groups = _full_state(model, optim)
    if rank0_only and dist.get_rank() != 0:
        return {}
    if offload_to_cpu:
        state = {fqn: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for fqn, s in state.items()}
    return {"state": state, "param_groups": groups}


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, offload_to_cpu: bool = False,
                             use_dtensor: bool = False) -> dict[str, Any]:
    """FQN-keyed state whose parameter-shaped tensors are chunks along dim 0 (``ShardedTensor`` or ``DTensor``)."""
    state, groups = _full_state(model, optim)
    entries = {fqn: entry for entry in param_entries(model).values() for fqn in entry.fqns}
    units = {id(unit.handle): unit for _, unit in _units(model)}
    sharded: dict[str, State] = {}
    for fqn, values in state.items():
        handle = entries[fqn].handle
        sharded[fqn] = {key: (sharded_value(value, units[id(handle)], use_dtensor, offload_to_cpu)
                              if handle is not None and isinstance(value, torch.Tensor) and value.dim() > 0
                              else value)
                        for key, value in values.items()}
    return {"state": sharded, "param_groups": groups}


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                     optim_state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """The optimizer state dict in the state-dict type ``model`` is set to."""
    units = named_states(model)
    if not units:
        raise ValueError("optim_state_dict: model contains no FullyShardedDataParallel unit")
    settings = units[0][1].state_dict_settings
    config = settings.optim_state_dict_config
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
        return full_optim_state_dict(model, optim, getattr(config, "rank0_only", False), config.offload_to_cpu)
    if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
        return sharded_optim_state_dict(model, optim, config.offload_to_cpu, getattr(config, "_use_dtensor", False))
    raise ValueError("optim_state_dict supports FULL_STATE_DICT and SHARDED_STATE_DICT; for per-rank state use "
                     "optim.state_dict() directly (it already holds only this rank's shards)")


# ---- loading ---------------------------------------------------------------------------------------

def from_rank0_if_rank0_only(model: nn.Module, optim_state_dict: dict[str, Any] | None,
                             group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Rank 0's full optimizer state dict on every rank of ``group`` if ``model`` loads ``rank0_only``, else ours.

    PyTorch's rank0_only load passes ``None`` on the other ranks; rank 0's dict is sent as one object
    (the path of a checkpoint load, never a training step). Every rank raises the same error when rank 0 passed
    ``None`` too.
    """
    units = named_states(model)
    if not units:
        raise ValueError("optim_state_dict_to_load: model contains no FullyShardedDataParallel unit")
    settings = units[0][1].state_dict_settings
    rank0_only = (settings.state_dict_type is StateDictType.FULL_STATE_DICT
                  and getattr(settings.optim_state_dict_config, "rank0_only", False))
    if not rank0_only:
        if optim_state_dict is None:
            raise ValueError(f"optim_state_dict_to_load: optim_state_dict is None on rank {dist.get_rank()}; pass "
                             "the optimizer state dict on every rank, or set a FULL_STATE_DICT state-dict type "
                             "with FullOptimStateDictConfig(rank0_only=True) to load rank 0's on every rank")
        return optim_state_dict
    holder = [optim_state_dict if dist.get_rank(group) == 0 else None]
    objects.broadcast_object_list(holder, 0, group, where="optim_state_dict_to_load (rank0_only)")
    if holder[0] is None:
        raise ValueError("optim_state_dict_to_load: the optimizer state-dict config is rank0_only, but rank 0 "
                         "passed None as optim_state_dict; pass the full optimizer state dict on rank 0")
    return holder[0]


def _as_full(value: Any, handle: FlatParamHandle | None) -> Any:
    if isinstance(value, (DTensor, ShardedTensor)) and handle is not None:
        return _full_tensor(value, handle)
    return value.full_tensor() if isinstance(value, DTensor) else value


def _local_value(entry: ParamEntry, values: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full per-parameter ``values``: the flat shard, or one parameter's piece."""
    handle = entry.handle
    assert handle is not None
    flat = torch.zeros(handle.layout.padded_numel, dtype=like.dtype, device=like.device)
    if entry.slot is None:
        for view, value in zip(handle.full_views(flat), values, strict=True):
            if value is not None:
                view.copy_(value)
        return handle.own_chunk(flat).clone().to(handle.flat_param.device)
    value = values[0]
    assert value is not None  # a single-parameter entry always has its value
    handle.full_views(flat)[entry.slot].copy_(value)
    start, end = handle.local_ranges()[entry.slot]
    return handle.own_chunk(flat)[start:end].clone().to(handle.flat_param.device)


ParamGroups = list[list[torch.Tensor]]


def param_groups(model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Any = None) -> ParamGroups:
    """The parameters of each group of the optimizer a loaded state dict is for.

    From ``optim`` if given, else from ``optim_input`` (parameters, or param-group
    dicts, as passed to the optimizer's constructor), else ``model.parameters()``
    as one group, as PyTorch's legacy optimizer state-dict functions assume.
    """
    if optim is not None:
        return [list(group["params"]) for group in optim.param_groups]
    if optim_input is None:
        return [list(model.parameters())]
    items = list(optim_input)
    if all(isinstance(item, dict) for item in items):
        return [list(item["params"]) if not isinstance(item["params"], torch.Tensor) else [item["params"]]
                for item in items]
    if all(isinstance(item, torch.Tensor) for item in items):
        return [items]
    raise TypeError("optim_input must be the parameters or the param-group dicts the optimizer was built from, "
                    f"got items of types {sorted({type(item).__name__ for item in items})}")


def optim_state_dict_to_load(model: nn.Module, groups: ParamGroups,
                             optim_state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict ``load_state_dict`` of an optimizer over ``groups`` accepts, from a full or sharded one."""
    entries = param_entries(model)
    saved_state = optim_state_dict["state"]
    state: dict[int, State] = {}
    for index, param in enumerate(param for group in groups for param in group):
        entry = _entry(entries, param)
        per_fqn = [{k: _as_full(v, entry.handle) for k, v in saved_state[fqn].items()} if fqn in saved_state else None
                   for fqn in entry.fqns]
        present = [s for s in per_fqn if s is not None]
        if not present:
            continue
        loaded: State = {}
        for key, sample in present[0].items():
            if entry.handle is None or not (isinstance(sample, torch.Tensor) and sample.dim() > 0):
                loaded[key] = _Scalar(sample).copy()
                continue
            values = [s[key] if s is not None else None for s in per_fqn]
            loaded[key] = _local_value(entry, values, sample)
        state[index] = loaded
    saved_groups = optim_state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"the saved optimizer state has {len(saved_groups)} param groups, the optimizer to load "
                         f"it has {len(groups)}; build the optimizer with the same groups")
    loaded_groups, next_index = [], 0
    for saved, group in zip(saved_groups, groups, strict=True):
        loaded_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                              "params": list(range(next_index, next_index + len(group)))})
        next_index += len(group)
    return {"state": state, "param_groups": loaded_groups}


# ---- re-keying -------------------------------------------------------------------------------------

def _fqn_order(model: nn.Module, groups: ParamGroups) -> list[str]:
    entries = param_entries(model)
    return [fqn for group in groups for param in group for fqn in _entry(entries, param).fqns]


def rekey_optim_state_dict(optim_state_dict: dict[str, Any], key_type: OptimStateKeyType,
                           model: nn.Module, groups: ParamGroups) -> dict[str, Any]:
    """Key a full optimizer state dict by parameter position in ``groups`` (PARAM_ID) or by FQN."""
    order = _fqn_order(model, groups)
    if key_type is OptimStateKeyType.PARAM_ID:
        rename: dict[Any, Any] = {fqn: index for index, fqn in enumerate(order)}
    elif key_type is OptimStateKeyType.PARAM_NAME:
        rename = dict(enumerate(order))
    else:
        raise ValueError(f"optim_state_key_type must be an OptimStateKeyType, got {key_type!r}")
    missing = [key for key in optim_state_dict["state"] if key not in rename and key not in rename.values()]
    if missing:
        raise KeyError(f"optimizer state for {missing[:3]} has no parameter in the model; pass the model the "
                       "state was saved from (or its unwrapped twin)")
    state = {rename.get(key, key): value for key, value in optim_state_dict["state"].items()}
    # Sorted: Optimizer.load_state_dict pairs saved and current parameters by position.
    renamed = [{**group, "params": sorted(rename.get(key, key) for key in group["params"])}
               for group in optim_state_dict["param_groups"]]
    return {"state": state, "param_groups": renamed}
