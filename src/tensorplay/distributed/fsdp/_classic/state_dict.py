"""State-dict hooks of classic FSDP units: full, local and sharded checkpoints.

``nn.Module.state_dict`` and ``load_state_dict`` walk the wrapped tree as usual;
each unit's hooks swap what its modules show for the walk, then put things back:

* before saving, the unit *installs* the tensors to save under the original
  parameter names (full tensors, ``DTensor`` chunks, or just the flat shard);
* after saving, it restores the registrations and drops the wrapper's
  ``_fsdp_wrapped_module.`` component from its keys;
* before loading, it adds that component back to its keys and installs tensors
  to load into; after loading, it copies them into its shard.

Each type is one object with those four steps (:data:`MODES`). A shape-only
save (``UnitState.describing`` set) installs meta placeholders instead: what
``load_check`` checks a state dict against before a load copies anything.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, init_from_local_shards

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import DeviceMesh
from tensorplay.distributed.tensor import DTensor, Replicate, Shard

from ..._sharding.layout import rank_slice
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from . import sharded_tensor
from .param_views import FLAT_PARAM
from .unit_state import WRAPPED_PREFIX, UnitState

if TYPE_CHECKING:
    from .flat_param import FlatParamHandle

_CONFIG_TYPES: dict[StateDictType, type[StateDictConfig]] = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
}


def default_config(state_dict_type: StateDictType) -> StateDictConfig:
    return _CONFIG_TYPES[state_dict_type]()


def check_config(state_dict_type: StateDictType, config: StateDictConfig, optim_config: OptimStateDictConfig) -> None:
    expected = _CONFIG_TYPES[state_dict_type]
    if not isinstance(config, expected):
        raise ValueError(f"{state_dict_type.name} takes a {expected.__name__}, got {type(config).__name__}")
    if state_dict_type is not StateDictType.FULL_STATE_DICT and isinstance(optim_config, FullOptimStateDictConfig):
        raise ValueError(f"{state_dict_type.name} cannot use a FullOptimStateDictConfig")


# ---- installing and restoring registrations --------------------------------------------------------

def _install(unit: UnitState, tensors: Sequence[torch.Tensor | None] | None, flat: torch.Tensor | None) -> None:
    """Show ``tensors`` under the original names and ``flat`` as ``_flat_param`` (None hides it)."""
    handle = unit.handle
    assert handle is not None
    saved: dict[tuple[nn.Module, str], object] = {}
    for slot, tensor in zip(handle.slots, tensors if tensors is not None else [None] * len(handle.slots), strict=True):
        for module, name in slot.places():
            saved[(module, name)] = module._parameters[name]
            # Plain tensors shown under parameter names, as PyTorch's FSDP does; the stubs expect Parameters.
            module._parameters[name] = tensor  # type: ignore[assignment]
    wrapped = handle.views.owner  # not unit.module: activation checkpointing may have wrapped it since
    saved[(wrapped, FLAT_PARAM)] = wrapped._parameters[FLAT_PARAM] if FLAT_PARAM in wrapped._parameters else _ABSENT
    wrapped._parameters[FLAT_PARAM] = flat  # type: ignore[assignment]  # a plain tensor or None, as above
    unit.saved_registrations = saved


_ABSENT = object()


def _restore(unit: UnitState) -> None:
    saved, unit.saved_registrations = unit.saved_registrations, {}
    for (module, name), value in saved.items():
        if value is _ABSENT:
            module._parameters.pop(name, None)
        else:
            module._parameters[name] = value  # type: ignore[assignment]  # what _install saved from there


def _rename(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Move keys starting with ``old`` to start with ``new``, keeping their order."""
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)


# ---- the three types -------------------------------------------------------------------------------

class FullStateDict:
    """Full tensors under the unwrapped model's names (gathered on every rank)."""

    def pre_save(self, unit: UnitState) -> None:
        handle = unit.handle
        assert handle is not None
        full = handle.gather_full()
        _install(unit, [view.detach().clone() for view in handle.full_views(full)], None)

    def post_save(self, unit: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
        if unit.state_dict_settings.state_dict_config.offload_to_cpu:
            for key in [k for k in state_dict if k.startswith(prefix)]:
                state_dict[key] = state_dict[key].cpu()

    def pre_load(self, unit: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
        handle = unit.handle
        assert handle is not None
        # Start from the current values: with strict=False, parameters missing from the dict keep them.
        unit.load_target = handle.gather_full()
        _install(unit, handle.full_views(unit.load_target), None)

    def post_load(self, unit: UnitState) -> None:
        assert unit.handle is not None and unit.load_target is not None
        target, unit.load_target = unit.load_target, None
        unit.handle.write_back(target)


class ShardedStateDict(FullStateDict):
    """Each parameter sharded along dim 0 over the unit's shard group (``ShardedTensor`` or ``DTensor``)."""

    def pre_save(self, unit: UnitState) -> None:
        handle = unit.handle
        assert handle is not None
        full = handle.gather_full()
        config = unit.state_dict_settings.state_dict_config
        assert isinstance(config, ShardedStateDictConfig)  # check_config pairs the type with its config
        _install(unit, [sharded_value(view, unit, config._use_dtensor, config.offload_to_cpu)
                        for view in handle.full_views(full)], None)

    def post_save(self, unit: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
        pass

    def pre_load(self, unit: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
        handle = unit.handle
        assert handle is not None
        converted: dict[int, torch.Tensor] = {}  # tied names often hold one object: gather it once
        for slot in handle.slots:
            for fqn in slot.fqns():
                key = prefix + WRAPPED_PREFIX + fqn
                value = state_dict.get(key)
                if isinstance(value, (DTensor, ShardedTensor)):
                    if id(value) not in converted:
                        converted[id(value)] = _full_tensor(value, handle)
                    state_dict[key] = converted[id(value)]
        super().pre_load(unit, state_dict, prefix)


def _full_tensor(value: DTensor | ShardedTensor, handle: FlatParamHandle) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` or a ``ShardedTensor`` (collective)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return sharded_tensor.full_tensor(value, _shard_group(handle), handle.placement.compute_device)


def sharded_value(full: torch.Tensor, unit: UnitState, use_dtensor: bool, offload_to_cpu: bool
                  ) -> DTensor | ShardedTensor:
    """``full``'s dim-0 chunk for this rank: a ``DTensor`` if asked for (or the unit has a device mesh, as in
    PyTorch), else a ``ShardedTensor``, PyTorch's default."""
    handle = unit.handle
    assert handle is not None
    if use_dtensor or unit.device_mesh is not None or full.dim() == 0:
        return _dtensor_chunk(full, _mesh(unit, handle), offload_to_cpu)
    return sharded_tensor.chunk_sharded_tensor(full, _shard_group(handle), offload_to_cpu)


class LocalStateDict:
    """This rank's flat shard under ``<unit>._flat_param``, as PyTorch lays it out; buffers as they are.

    The value is a ``ShardedTensor`` over the unpadded flat parameter whose
    local shard is this rank's part without padding (a view, no copy), so local
    state dicts load across ours and PyTorch's. A plain tensor holding this
    rank's padded shard loads too.
    """

    def pre_save(self, unit: UnitState) -> None:
        assert unit.handle is not None
        _install(unit, None, unit.handle.flat_param)

    def post_save(self, unit: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
        key = prefix + FLAT_PARAM
        assert unit.handle is not None
        local = _sharded_flat(unit.handle, state_dict[key])
        state_dict[key] = local.cpu() if unit.state_dict_settings.state_dict_config.offload_to_cpu else local

    def pre_load(self, unit: UnitState, state_dict: dict[str, Any], prefix: str) -> None:
        key = prefix + WRAPPED_PREFIX + FLAT_PARAM
        assert unit.handle is not None
        if key in state_dict:
            state_dict[key] = _padded_shard(unit.handle, state_dict[key], key)
        _install(unit, None, unit.handle.flat_param)

    def post_load(self, unit: UnitState) -> None:
        pass


def _shard_group(handle: FlatParamHandle) -> dist.ProcessGroup:
    group = handle.plan.shard_group or handle.plan.replicate_group
    assert group is not None
    return group


def _sharded_flat(handle: FlatParamHandle, shard: torch.Tensor) -> ShardedTensor | torch.Tensor:
    """``shard`` (this rank's padded flat shard) as a ``ShardedTensor`` over the unpadded flat parameter.

    Collective over the shard group. Unsharded units (NO_SHARD) keep the plain tensor: every rank holds all of it.
    """
    if not handle.is_sharded_over_ranks:
        return shard[:handle.layout.numel]
    start, end = handle.layout.shard_range(handle.plan.shard_rank)
    valid = max(0, min(end, handle.layout.numel) - start)
    local = [LocalShard.from_tensor_and_offsets(shard[:valid], [start], handle.plan.shard_rank)] if valid else []
    return init_from_local_shards(local, handle.layout.numel, process_group=handle.plan.shard_group)


def local_problem(handle: FlatParamHandle, value: Any, key: str) -> str | None:
    """Why ``value`` cannot be loaded as this rank's flat shard from a local state dict (None: it can)."""
    start, _ = handle.layout.shard_range(handle.plan.shard_rank)
    padded, numel, rank = tuple(handle.flat_param.shape), handle.layout.numel, dist.get_rank()
    if isinstance(value, ShardedTensor):
        if tuple(value.size()) != (numel,):
            return (f"size mismatch for {key}: copying a flat parameter of {tuple(value.size())} elements from "
                    f"checkpoint, this unit's has ({numel},); load it into the same model with the same wrapping "
                    "(and use_orig_params setting)")
        offsets = [shard.metadata.shard_offsets[0] for shard in value.local_shards()]
        if len(offsets) > 1 or any(offset != start for offset in offsets):
            return (f"local state dict entry {key!r} holds elements at offsets {offsets} on rank {rank}, this "
                    f"rank's shard starts at {start}; load it with the same world size")
        return None
    if not isinstance(value, torch.Tensor):
        given = "a non-tensor value"
    elif tuple(value.shape) == padded or (tuple(value.shape) == (numel,) and not handle.is_sharded_over_ranks):
        return None
    else:
        given = f"a param with shape {value.shape}"
    return (f"size mismatch for {key}: copying {given} from checkpoint, rank {rank}'s flat shard is "
            f"{torch.Size(padded)} (or a ShardedTensor of {torch.Size([numel])}); load it with the same world "
            "size and wrapping")


def _padded_shard(handle: FlatParamHandle, value: Any, key: str) -> torch.Tensor:
    """This rank's padded flat shard from a local state dict value (ours or PyTorch's)."""
    problem = local_problem(handle, value, key)
    if problem is not None:
        raise ValueError(problem)
    expected = handle.flat_param.shape
    if isinstance(value, ShardedTensor):
        padded = torch.zeros(expected, dtype=handle.flat_param.dtype, device=handle.flat_param.device)
        shards = value.local_shards()
        if shards:
            padded[:shards[0].tensor.numel()].copy_(shards[0].tensor)
        return padded
    if value.shape != expected:  # the unpadded flat parameter of an unsharded unit
        return torch.cat([value, value.new_zeros(expected.numel() - value.numel())])
    return value


MODES: dict[StateDictType, FullStateDict | ShardedStateDict | LocalStateDict] = {
    StateDictType.FULL_STATE_DICT: FullStateDict(),
    StateDictType.SHARDED_STATE_DICT: ShardedStateDict(),
    StateDictType.LOCAL_STATE_DICT: LocalStateDict(),
}


def _mesh(unit: UnitState, handle: FlatParamHandle) -> DeviceMesh:
    """The 1D mesh over the unit's shard group (replicate group for NO_SHARD), made once per unit."""
    if unit.dtensor_mesh is None:
        unit.dtensor_mesh = DeviceMesh.from_group(_shard_group(handle), handle.placement.compute_device.type)
    return unit.dtensor_mesh


def _dtensor_chunk(full: torch.Tensor, mesh: DeviceMesh, offload_to_cpu: bool) -> DTensor:
    """``full``'s dim-0 chunk for this rank as a ``DTensor`` (replicated for 0-d tensors)."""
    if full.dim() == 0:
        return DTensor.from_local(full.detach().clone(), mesh, [Replicate()], run_check=False)
    part = rank_slice(full.shape[0], mesh.size(), mesh.get_local_rank())
    local = full.detach().narrow(0, part.start, part.size).clone()
    if offload_to_cpu:
        local = local.cpu()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


# ---- the hooks -------------------------------------------------------------------------------------

def _mode(unit: UnitState) -> FullStateDict | ShardedStateDict | LocalStateDict:
    """The unit's state-dict type; as in PyTorch, a NO_SHARD unit always saves and loads full tensors."""
    asked = unit.state_dict_settings.state_dict_type
    if _effective_type(unit) is not asked:
        warnings.warn("When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned "
                      f"(unit {unit.name!r} asked for {asked.name}).", UserWarning, stacklevel=4)
    return MODES[_effective_type(unit)]


def _effective_type(unit: UnitState) -> StateDictType:
    if unit.plan.strategy is ShardingStrategy.NO_SHARD:
        return StateDictType.FULL_STATE_DICT
    return unit.state_dict_settings.state_dict_type


def register_hooks(module: nn.Module, unit: UnitState) -> None:
    """Make ``module`` (the wrapper of ``unit``) save and load in ``unit``'s state-dict type."""
    module.register_state_dict_pre_hook(functools.partial(_pre_save, unit))
    module._register_state_dict_hook(functools.partial(_post_save, unit))
    module._register_load_state_dict_pre_hook(functools.partial(_pre_load, unit))
    module.register_load_state_dict_post_hook(functools.partial(_post_load, unit))


def _pre_save(unit: UnitState, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if unit.handle is None:
        return
    if unit.describing is not None:
        _install_placeholders(unit, unit.describing)
    else:
        _mode(unit).pre_save(unit)


def _post_save(unit: UnitState, module: nn.Module, state_dict: dict[str, Any], prefix: str,
               local_metadata: Any) -> None:
    if unit.handle is not None:
        _restore(unit)
    _rename(state_dict, prefix + WRAPPED_PREFIX, prefix)
    if unit.describing is not None:
        return
    if _rank0_only(unit) and dist.get_rank() != 0:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
    elif unit.handle is not None:
        _mode(unit).post_save(unit, state_dict, prefix)


def _rank0_only(unit: UnitState) -> bool:
    config = unit.state_dict_settings.state_dict_config
    return unit.state_dict_settings.state_dict_type is StateDictType.FULL_STATE_DICT \
        and isinstance(config, FullStateDictConfig) and config.rank0_only


def _pre_load(unit: UnitState, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    inner = prefix + WRAPPED_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
    if unit.handle is not None:
        _mode(unit).pre_load(unit, state_dict, prefix)


def _post_load(unit: UnitState, module: nn.Module, incompatible_keys: Any) -> None:
    if unit.handle is not None:
        _mode(unit).post_load(unit)
        _restore(unit)
        unit.handle.views.after_load(unit.handle)
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [key.replace(WRAPPED_PREFIX, "") for key in keys]


# ---- shape-only saves (``load_check``) ---------------------------------------------------------

def _install_placeholders(unit: UnitState, flats: dict[int, UnitState]) -> None:
    """Show meta tensors of the shapes a load of the unit's type expects (``unit.describing``: see
    ``load_check``); each is recorded in ``flats``."""
    handle = unit.handle
    assert handle is not None
    dtype = handle.flat_param.dtype
    if _effective_type(unit) is StateDictType.LOCAL_STATE_DICT:
        flat = torch.empty(handle.layout.numel, dtype=dtype, device="meta")
        flats[id(flat)] = unit
        _install(unit, None, flat)
    else:
        placeholders = [torch.empty(shape, dtype=dtype, device="meta") for shape in handle.layout.shapes]
        flats.update(dict.fromkeys(map(id, placeholders), unit))  # whose they are (sharded keys: load_check)
        _install(unit, placeholders, None)
