"""Model and optimizer state dicts keyed by FQN under any strategy, so a checkpoint moves between them.

PyTorch's helpers (used here for single process, DDP and fully_shard, whose
parameters are plain tensors or DTensors) do not know our classic
``FullyShardedDataParallel`` (its optimizer holds flat parameters: the state came
out under flat-parameter names nothing else could load) nor
``ZeroRedundancyOptimizer``. For those two:

- classic FSDP: the wrapper's own public API, ``state_dict_type(SHARDED_STATE_DICT)``
  and ``optim_state_dict`` / ``optim_state_dict_to_load``: FQN keys, ``DTensor``
  chunks along dim 0, which DCP reshards into any other layout;
- ZeRO: each rank contributes the state of the parameters it owns, keyed by FQN,
  straight from its local optimizer; no rank gathers the whole optimizer state
  (``consolidate_state_dict`` does, on one rank). Loading, each rank asks for the
  FQNs it owns under its own partition, so any world size reads any checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _torch_sd
from torch.distributed.checkpoint.state_dict import (
    FQNS_T,
    DictValueType,
    ListDictValueType,
    OptimizerStateType,
    PrimitiveType,
    StateDictOptions,
    ValueType,
)

from tensorplay.distributed._checks.whole_load import whole_load_check
from tensorplay.distributed.checkpoint._in_backward import allows_template_steps, merged_if_in_backward

if TYPE_CHECKING:
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

__all__ = [
    "FQNS_T",
    "DictValueType",
    "ListDictValueType",
    "OptimizerStateType",
    "PrimitiveType",
    "StateDictOptions",
    "ValueType",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


# ---- which strategy ------------------------------------------------------------------------------

def _classic(model: nn.Module) -> Any:
    """Our classic FSDP class when ``model`` holds one of its units, else None."""
    from tensorplay.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel if FullyShardedDataParallel.fsdp_modules(model) else None


def _zero(optimizers: Any) -> Any:
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    return optimizers if isinstance(optimizers, ZeroRedundancyOptimizer) else None


def _sharded_matrix(optim: torch.optim.Optimizer) -> bool:
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    return isinstance(optim, ShardedMatrixOptimizer)


def _owner_scheme(optimizers: Iterable[torch.optim.Optimizer]) -> list[ShardedMatrixOptimizer]:
    """The ``ShardedMatrixOptimizer``s among ``optimizers`` whose matrices' state lives on their owners (Muon)."""
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    return [optim for optim in optimizers if isinstance(optim, ShardedMatrixOptimizer) and optim.inner is not None]


def _full_owner_state(optimizers: list[torch.optim.Optimizer], options: StateDictOptions) -> ExitStack:
    """For a full state dict: every owner-scheme ``ShardedMatrixOptimizer``'s ``state_dict()`` holds every
    matrix's state on every rank, each owner sending its own (collective)."""
    stack = ExitStack()
    if options.full_state_dict:
        for optim in _owner_scheme(optimizers):
            stack.enter_context(optim.full_state())
    return stack


def _as_torch_returns(state_dict: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    """``state_dict`` as PyTorch's helpers return theirs: ``cpu_offload`` moves it to CPU, and with
    ``full_state_dict`` too only rank 0 keeps it (the other ranks get ``{}``)."""
    from torch.distributed._state_dict_utils import _gather_state_dict, _offload_state_dict_to_cpu

    if options.full_state_dict and options.cpu_offload:
        return _gather_state_dict(state_dict, cpu_offload=True,
                                  ranks_only=(0,) if torch.distributed.is_initialized() else ())
    return _offload_state_dict_to_cpu(state_dict) if options.cpu_offload else state_dict


def _set_with_torch(model: nn.Module, optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
                    optim_state_dict: OptimizerStateType, options: StateDictOptions) -> None:
    """PyTorch's loader. A full state dict holds an owner-scheme ``ShardedMatrixOptimizer``'s state as whole
    tensors, which it loads as they are (PyTorch's full-state path would place them by this rank's own
    state tensors, and a rank that owns no matrix has none)."""
    listed = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
    owner = _owner_scheme(listed)
    if not owner or not options.full_state_dict or options.broadcast_from_rank0:
        _torch_sd.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
        return
    rest = [optim for optim in listed if all(optim is not other for other in owner)]
    if rest:
        _torch_sd.set_optimizer_state_dict(model, rest, optim_state_dict, options=options)
    _torch_sd.set_optimizer_state_dict(model, list(owner), optim_state_dict,
                                       options=replace(options, full_state_dict=False))


def _single(optimizers: Any, what: str) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    merged = merged_if_in_backward(optimizers)  # one optimizer per parameter (apply_optimizer_in_backward)
    if merged is not None:
        return merged
    if len(optimizers) != 1:
        raise ValueError(f"{what}: with classic FullyShardedDataParallel or ZeroRedundancyOptimizer pass one "
                         f"optimizer, got {len(optimizers)}")
    return optimizers[0]


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _classic_context(fsdp: Any, model: nn.Module, options: StateDictOptions) -> Any:
    from tensorplay.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    if options.full_state_dict:
        return fsdp.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                    FullStateDictConfig(offload_to_cpu=options.cpu_offload, rank0_only=False),
                                    FullOptimStateDictConfig(offload_to_cpu=options.cpu_offload, rank0_only=False))
    return fsdp.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                                ShardedStateDictConfig(offload_to_cpu=options.cpu_offload),
                                ShardedOptimStateDictConfig(offload_to_cpu=options.cpu_offload))


# ---- ZeRO: each rank its own parameters ----------------------------------------------------------

def _fqns(model: nn.Module) -> dict[torch.Tensor, str]:
    return {param: fqn for fqn, param in _unwrapped(model).named_parameters()}


def _groups(zero: Any, fqns: dict[torch.Tensor, str]) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": [fqns[p] for p in group["params"]]}
            for group in zero.param_groups]


def _zero_state(model: nn.Module, zero: Any) -> dict[str, Any]:
    local = zero.optim
    _torch_sd._init_optim_state(local)  # a fresh optimizer: a template of the right shapes to load into
    fqns = _fqns(model)
    state = {fqns[p]: dict(local.state[p]) for group in local.param_groups for p in group["params"]
             if p in local.state}
    return {"state": state, "param_groups": _groups(zero, fqns)}


def _set_zero_state(model: nn.Module, zero: Any, saved: dict[str, Any]) -> None:
    if not hasattr(zero.optim, "load_state_dict"):
        raise ValueError("set_optimizer_state_dict: a ZeroRedundancyOptimizer with overlap_with_ddp=True loads "
                         "its state after its first step; call this after that step")
    fqns = _fqns(model)
    local = zero.optim
    missing = [fqns[p] for g in local.param_groups for p in g["params"] if fqns[p] not in saved["state"]]
    if missing:
        raise ValueError(f"set_optimizer_state_dict: rank {zero.rank} owns parameters with no saved optimizer "
                         f"state: {missing}; load the template from get_optimizer_state_dict on this rank")
    if len(saved["param_groups"]) != len(zero.param_groups):
        raise ValueError(f"set_optimizer_state_dict: {len(saved['param_groups'])} saved param groups, the "
                         f"optimizer has {len(zero.param_groups)}")
    for group, saved_group in zip(zero.param_groups, saved["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    indexed = [p for g in local.param_groups for p in g["params"]]
    local_groups, start = [], 0
    for group, global_group in zip(local.param_groups, zero.param_groups, strict=True):  # one local group each
        count = len(group["params"])
        local_groups.append({**{k: v for k, v in global_group.items() if k != "params"},
                             "params": list(range(start, start + count))})
        start += count
    local.load_state_dict({"state": {i: saved["state"][fqns[p]] for i, p in enumerate(indexed)},
                           "param_groups": local_groups})


# ---- public helpers ------------------------------------------------------------------------------

def get_model_state_dict(model: nn.Module, *, submodules: set[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, ValueType]:
    """The model's state dict keyed by FQN (PyTorch's ``get_model_state_dict``; also classic FSDP).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.checkpoint.state_dict import get_model_state_dict
        >>> model = tp.nn.Sequential(tp.nn.Linear(4, 2))
        >>> sorted(get_model_state_dict(model))
        ['0.bias', '0.weight']
    """
    options = options or StateDictOptions()
    fsdp = _classic(model)
    if fsdp is None:
        return _torch_sd.get_model_state_dict(model, submodules=submodules, options=options)
    with _classic_context(fsdp, model, options):
        return model.state_dict()


@allows_template_steps
def get_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             *, submodules: set[nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> OptimizerStateType:
    """The optimizer state keyed by parameter FQN (PyTorch's; also classic FSDP and ZeRO, see the module doc).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.checkpoint.state_dict import get_optimizer_state_dict
        >>> model = tp.nn.Sequential(tp.nn.Linear(4, 2))
        >>> optimizer = tp.optim.Adam(model.parameters())
        >>> model(tp.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> sorted(get_optimizer_state_dict(model, optimizer)["state"])   # keyed by parameter names, not numbers
        ['0.bias', '0.weight']
    """
    options = options or StateDictOptions()
    if not isinstance(optimizers, torch.optim.Optimizer):
        optimizers = list(optimizers)
    fsdp = _classic(model)
    if _zero(optimizers) is not None:
        return cast(OptimizerStateType, _zero_state(model, optimizers))  # the same layout, keyed by FQN
    if fsdp is None:
        with _full_owner_state([optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers, options):
            return _torch_sd.get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options)
    optim = _single(optimizers, "get_optimizer_state_dict")
    _torch_sd._init_optim_state(optim)
    if _sharded_matrix(optim):   # whole-matrix state: see optim/matrix/_state.py
        from tensorplay.distributed.optim.matrix import fqn_state_dict
        state = fqn_state_dict(model, optim, full=options.full_state_dict)  # type: ignore[arg-type]
        return cast(OptimizerStateType, _as_torch_returns(state, options))
    with _classic_context(fsdp, model, options):
        return fsdp.optim_state_dict(model, optim)


def get_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *,
                   submodules: set[nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, ValueType], OptimizerStateType]:
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))``.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> from tensorplay.distributed.checkpoint.state_dict import get_state_dict
        >>> model = tp.nn.Linear(4, 2)
        >>> optimizer = tp.optim.AdamW(model.parameters())
        >>> model_sd, optim_sd = get_state_dict(model, optimizer)
        >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")
        Metadata(...)
    """
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, ValueType], *,
                         options: StateDictOptions | None = None) -> Any:
    """Load an FQN-keyed model state dict (PyTorch's ``set_model_state_dict``; also classic FSDP).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.checkpoint.state_dict import set_model_state_dict
        >>> source, target = tp.nn.Linear(4, 2), tp.nn.Linear(4, 2)
        >>> set_model_state_dict(target, source.state_dict())
        <All keys matched successfully>
        >>> tp.equal(target.weight, source.weight)
        True
    """
    options = options or StateDictOptions()
    fsdp = _classic(model)
    if fsdp is None:
        with _whole_model_checked(model, model_state_dict, options):
            return _torch_sd.set_model_state_dict(model, model_state_dict, options=options)
    with _classic_context(fsdp, model, options), _whole_model_checked(model, model_state_dict, options):
        return model.load_state_dict(model_state_dict, strict=options.strict)


def _whole_model_checked(model: nn.Module, model_state_dict: dict[str, ValueType],
                         options: StateDictOptions) -> AbstractContextManager[None]:
    """All or nothing on every rank when a plain root holds sharded modules (a sharded root's
    ``load_state_dict`` checks itself; see [Note: load through a plain parent]); with
    ``broadcast_from_rank0`` only rank 0 holds the state dict, and PyTorch's path checks it."""
    check = whole_load_check(model)
    if check is None or options.broadcast_from_rank0:
        return nullcontext()
    return check(model, model_state_dict, options.strict)


@allows_template_steps
def set_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             optim_state_dict: OptimizerStateType, *,
                             options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed optimizer state dict (PyTorch's; also classic FSDP and ZeRO).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        >>> model = tp.nn.Linear(4, 2)
        >>> optimizer = tp.optim.Adam(model.parameters())
        >>> model(tp.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> saved = get_optimizer_state_dict(model, optimizer)
        >>> fresh = tp.optim.Adam(model.parameters())
        >>> set_optimizer_state_dict(model, fresh, saved)
        >>> fresh.state_dict()["state"][0]["step"]
        tensor(1.)
    """
    options = options or StateDictOptions()
    if _zero(optimizers) is not None:
        _set_zero_state(model, optimizers, dict(optim_state_dict))
        return
    fsdp = _classic(model)
    if fsdp is None:
        _set_with_torch(model, optimizers if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers),
                        optim_state_dict, options)
        return
    optim = _single(optimizers, "set_optimizer_state_dict")
    if _sharded_matrix(optim):
        from tensorplay.distributed.optim.matrix import load_fqn_state_dict
        load_fqn_state_dict(model, optim, dict(optim_state_dict))  # type: ignore[arg-type]
        return
    with _classic_context(fsdp, model, options):
        optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim, optim_state_dict))


def set_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *,
                   model_state_dict: dict[str, ValueType], optim_state_dict: OptimizerStateType,
                   options: StateDictOptions | None = None) -> Any:
    """``set_model_state_dict`` then ``set_optimizer_state_dict``; returns the model's incompatible keys.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> from tensorplay.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        >>> model = tp.nn.Linear(4, 2)
        >>> optimizer = tp.optim.AdamW(model.parameters())
        >>> model_sd, optim_sd = get_state_dict(model, optimizer)
        >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")
        Metadata(...)
        >>> model_sd, optim_sd = get_state_dict(model, optimizer)   # the shapes to load into
        >>> state = {"model": model_sd, "optim": optim_sd}
        >>> dcp.load(state, checkpoint_id="ckpt")
        >>> set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        <All keys matched successfully>
    """
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


def __getattr__(name: str) -> object:
    """Any other name of PyTorch's ``torch.distributed.checkpoint.state_dict`` (the same object)."""
    import torch.distributed.checkpoint.state_dict as torch_module

    try:
        return getattr(torch_module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
