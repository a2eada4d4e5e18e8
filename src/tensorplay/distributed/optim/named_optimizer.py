"""``_NamedOptimizer``: a ``tp.optim`` optimizer whose state dict is keyed by parameter FQN.

A plain optimizer's state dict numbers parameters by their position in its
groups, so it only loads into an optimizer built in the same order. This
wrapper keys ``state`` and each group's ``params`` by the fully qualified names
it was given, so a checkpoint survives re-ordering and partial groups
(conditional training).

With a classic ``FullyShardedDataParallel`` ``module``, ``state_dict`` and
``load_state_dict`` go through ``FullyShardedDataParallel.optim_state_dict`` /
``optim_state_dict_to_load``, so the keys are the unwrapped model's FQNs and the
layout follows the model's state-dict type (full or sharded; a
``LOCAL_STATE_DICT`` model keeps this rank's flat state under the names given).
With ``fully_shard`` the parameters are ``DTensor`` s and so is their state.

Where PyTorch 2.13's class differs, ours does better: its ``zero_grad`` raises
``AttributeError``; with a classic FSDP module its ``state_dict`` drops the
FQN-keyed result and returns the flat, per-rank state (which its own
``load_state_dict`` then refuses with a ``KeyError``); and a bad state dict can be
half loaded before it fails. Ours checks everything first and loads all or
nothing (one :class:`StateDictLoadError`, a ``ValueError``, listing every
problem; see [Note: all-or-nothing loads]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor, nn

from tensorplay.distributed._checks.load_check import LoadProblems, StateDictLoadError, agree_on_all_ranks
from tensorplay.distributed._sharding.param_entries import param_entries
from tensorplay.distributed.tensor import DTensor, distribute_tensor

__all__: list[str] = []

State = dict[str, Any]
#: How many names a message lists before it says "and N more".
_MAX_LISTED = 8


class _NamedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_class`` over ``named_parameters``; expose its state keyed by FQN.

    Args:
        named_parameters: FQN -> parameter (``module.named_parameters()``).
        optimizer_class: the ``tp.optim`` class to build.
        param_groups: groups to build it with (their ``params`` must be among
            ``named_parameters``); default: one group of every parameter.
        module: the model the parameters belong to; a classic FSDP model makes
            the state dict go through its optimizer-state-dict functions.
        args, kwargs: the rest of ``optimizer_class``'s arguments.

    ``load_state_dict`` copies into the existing state in place, so the state
    must exist first: call :meth:`init_state` (or :meth:`step`) before loading.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _NamedOptimizer
        >>> model = tp.nn.Sequential(tp.nn.Linear(4, 2))
        >>> optimizer = _NamedOptimizer(model.named_parameters(), tp.optim.Adam, module=model, lr=0.1)
        >>> model(tp.randn(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state_dict()["state"])       # keyed by parameter names
        ['0.bias', '0.weight']
    """

    named_parameters: dict[str, Tensor]
    ordered_param_keys: list[str]
    module: nn.Module | None
    param_groups: list[dict[str, Any]]

    def __init__(self, named_parameters: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
                 optimizer_class: type[torch.optim.Optimizer],
                 param_groups: Collection[Mapping[str, Any]] | None = None,
                 module: nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        torch._C._log_api_usage_once("tensorplay.distributed.optim._NamedOptimizer")
        self.named_parameters = dict(named_parameters)
        self.module = module
        if param_groups is None:
            self.ordered_param_keys = list(self.named_parameters)
            self._optimizer = optimizer_class(list(self.named_parameters.values()), *args, **kwargs)
        else:
            groups = [_checked_group(group, f"param_groups[{index}]") for index, group in enumerate(param_groups)]
            self.ordered_param_keys = self._keys_of([p for g in groups for p in g["params"]], "param_groups")
            warnings.warn("Since we pass in param_groups, we will use param_groups to initialize the optimizer, "
                          "not all parameters of the module.", stacklevel=2)
            self._optimizer = optimizer_class(groups, *args, **kwargs)
        self.param_groups = self._optimizer.param_groups

    # ---- the wrapped optimizer's surface ------------------------------------------------------------

    @property
    def state(self) -> Mapping[Tensor, Any]:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of the wrapped optimizer."""
        return self._optimizer.step(closure=closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter this optimizer holds (PyTorch's raises ``AttributeError``)."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Mapping[str, Any]) -> None:
        """Add a group whose ``params`` are among ``named_parameters`` (checked before anything changes)."""
        group = _checked_group(param_group, "param_group")
        keys = self._keys_of(group["params"], "add_param_group")
        self._optimizer.add_param_group(group)
        self.ordered_param_keys.extend(keys)
        self.param_groups = self._optimizer.param_groups

    def init_state(self) -> None:
        """Create the optimizer's lazily built state with one step on zero gradients.

        As in PyTorch, every parameter that requires grad gets a zero ``.grad``
        (replacing any it had) and the wrapped optimizer steps once, which is
        what makes its state exist for an in-place :meth:`load_state_dict`.
        """
        for param in self.named_parameters.values():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        self.step(closure=None)

    # ---- state dicts ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {fqn: state}, "param_groups": [{"params": [fqn, ...], ...}]}``."""
        module = self._fsdp_module()
        if module is not None:
            return _fsdp().optim_state_dict(module, self._optimizer)
        return self._named_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Copy ``state_dict`` (FQN-keyed, from :meth:`state_dict`) into the existing state, all or nothing.

        FQNs absent from ``state_dict`` keep their state (a parameter that was not
        trained); an FQN this optimizer does not hold, a missing or extra state
        key, or a tensor of another shape refuses the whole load, listing every
        problem found.
        """
        current = self._optimizer.state_dict()
        if not current["state"]:
            raise ValueError("Expects the optim to be initialized before load but found not initialized: "
                             "call init_state() (or step()) once before load_state_dict")
        named = self._named_to_load(_checked_state_dict(state_dict))
        problems = self._load_problems(named, current)
        if problems:
            raise StateDictLoadError("_NamedOptimizer", problems)
        self._copy_state(named["state"], current["state"])
        self._copy_group_options(named["param_groups"], current["param_groups"])
        self._optimizer.load_state_dict(current)

    def _named_state_dict(self) -> dict[str, Any]:
        numbered = self._optimizer.state_dict()
        keys = self.ordered_param_keys
        state = {keys[index]: value for index, value in numbered["state"].items()}
        groups = [{"params": sorted(keys[index] for index in group["params"]),
                   **{k: deepcopy(v) for k, v in group.items() if k != "params"}}
                  for group in numbered["param_groups"]]
        return {"state": state, "param_groups": groups}

    def _named_to_load(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state_dict`` in this optimizer's key space: the names it was given."""
        module = self._fsdp_module()
        if module is None:
            return state_dict
        # optim_state_dict_to_load is collective: a rank must not refuse alone, or the others block in it.
        problems = _fsdp_problems(module, self._optimizer, state_dict)
        agree_on_all_ranks(StateDictLoadError("_NamedOptimizer", problems) if problems else None,
                           where="_NamedOptimizer")
        numbered = _fsdp().optim_state_dict_to_load(module, self._optimizer, dict(state_dict))
        keys = self.ordered_param_keys
        return {"state": {keys[index]: value for index, value in numbered["state"].items()},
                "param_groups": [{**group, "params": [keys[index] for index in group["params"]]}
                                 for group in numbered["param_groups"]]}

    # ---- checks and copies ---------------------------------------------------------------------------

    def _load_problems(self, named: Mapping[str, Any], current: dict[str, Any]) -> LoadProblems:
        known = set(self.ordered_param_keys)
        problems = LoadProblems(unexpected=[f"state.{fqn}" for fqn in named["state"] if fqn not in known])
        problems.unexpected += list(dict.fromkeys(f"param_groups.params.{fqn}" for group in named["param_groups"]
                                                  for fqn in group["params"] if fqn not in known))
        if problems.unexpected:
            problems.other.append(f"this optimizer holds {_listed(self.ordered_param_keys)}: load a state dict "
                                  "saved for the same parameters, or build the optimizer over them")
        params = [param for group in self._optimizer.param_groups for param in group["params"]]
        for index, fqn in enumerate(self.ordered_param_keys):
            if fqn not in named["state"]:
                continue
            # No state yet (e.g. a rank whose piece of the parameter is empty): the state is taken as saved.
            like = current["state"].get(index) or _fresh_state(named["state"][fqn], params[index])
            _state_problems(problems, fqn, named["state"][fqn], like)
        saved_groups = _groups_by_params(named["param_groups"])
        for group in current["param_groups"]:
            key = _group_key(self.ordered_param_keys[index] for index in group["params"])
            saved = saved_groups.get(key)
            if saved is not None and set(saved) != set(group):
                problems.other.append(f"param group {list(key)[:_MAX_LISTED]}: options {sorted(saved)} but this "
                                      f"optimizer's group has {sorted(group)}")
        return problems

    def _copy_state(self, saved: Mapping[str, State], current: dict[int, State]) -> None:
        for index, fqn in enumerate(self.ordered_param_keys):
            if fqn not in saved:
                continue  # not trained in the saved run: keep this state
            if index not in current:
                current[index] = {key: _copied(value, None) for key, value in saved[fqn].items()}
                continue
            for key, target in current[index].items():
                current[index][key] = _copied(saved[fqn][key], target)

    def _copy_group_options(self, saved_groups: list[Mapping[str, Any]], current: list[dict[str, Any]]) -> None:
        saved_by_params = _groups_by_params(saved_groups)
        for group in current:
            saved = saved_by_params.get(_group_key(self.ordered_param_keys[i] for i in group["params"]))
            if saved is not None:  # a group the saved run did not have keeps its options
                group.update({k: deepcopy(v) for k, v in saved.items() if k != "params"})

    def _keys_of(self, params: Iterable[Tensor], where: str) -> list[str]:
        """The FQN of each of ``params``; refuse (naming them) any that ``named_parameters`` lacks."""
        fqn_of: dict[int, str] = {}
        for fqn, param in self.named_parameters.items():
            fqn_of.setdefault(id(param), fqn)
        params = list(params)
        missing = [f"{type(p).__name__} of shape {tuple(p.shape)}" for p in params if id(p) not in fqn_of]
        if missing:
            raise ValueError(f"{where}: some parameters are not in the module: {_listed(missing)} are not among "
                             "named_parameters; pass parameters of the model this optimizer was built for")
        return [fqn_of[id(p)] for p in params]

    def _fsdp_module(self) -> nn.Module | None:
        """``module`` when it holds classic FSDP units and its state-dict type is full or sharded (their
        optimizer-state-dict functions then apply); None for a plain, fully_shard or local-state-dict model."""
        if self.module is None or not _fsdp().fsdp_modules(self.module):
            return None
        from tensorplay.distributed.fsdp import StateDictType
        local = _fsdp().get_state_dict_type(self.module).state_dict_type is StateDictType.LOCAL_STATE_DICT
        return None if local else self.module


# ---- module helpers -------------------------------------------------------------------------------------

def _checked_group(group: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A copy of ``group`` whose ``params`` is a list of tensors (the caller's dict is left alone)."""
    if not isinstance(group, Mapping):
        raise TypeError(f"{where} must be a dict with a 'params' key, got {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{where} must contain the key 'params' (its parameters); got keys {sorted(group)}")
    params = group["params"]
    params = [params] if isinstance(params, Tensor) else list(params)
    for index, param in enumerate(params):
        if not isinstance(param, Tensor):
            raise TypeError(f"{where}['params'][{index}]: optimizer can only optimize Tensors, "
                            f"but one of the params is {torch.typename(param)}")
    return {**group, "params": params}


def _checked_state_dict(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        found = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(f"_NamedOptimizer.load_state_dict expects a dict with 'state' and 'param_groups' "
                         f"(what state_dict() returns), got {found}")
    return state_dict


def _fsdp() -> Any:
    """The classic FSDP class (imported late: the fsdp package is not needed for plain models)."""
    from tensorplay.distributed.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel


def _group_key(fqns: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(fqns))


def _groups_by_params(groups: Iterable[Mapping[str, Any]]) -> dict[tuple[str, ...], Mapping[str, Any]]:
    return {_group_key(group["params"]): group for group in groups}


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"


def _local_shards(value: Any) -> list[Any] | None:
    """A ShardedTensor's local shards (``None`` for anything else)."""
    shards = getattr(value, "local_shards", None)  # a ShardedTensor is a Tensor subclass: test the method
    return shards() if callable(shards) else None


def _state_problems(problems: LoadProblems, fqn: str, saved: Any, current: State) -> None:
    """Add to ``problems`` what keeps ``saved`` (one parameter's state) from loading into ``current``."""
    if not isinstance(saved, Mapping):
        problems.other.append(f"state.{fqn}: its state must be a dict of state values, got {type(saved).__name__}")
        return
    if set(saved) != set(current):
        problems.missing += [f"state.{fqn}.{key}" for key in current if key not in saved]
        problems.unexpected += [f"state.{fqn}.{key}" for key in saved if key not in current]
        problems.other.append(f"state.{fqn}: state keys {sorted(saved)} but this optimizer's state has "
                              f"{sorted(current)} (was it saved from another optimizer class or options?)")
        return
    for key, target in current.items():
        value, name = saved[key], f"state.{fqn}.{key}"
        target_shards, value_shards = _local_shards(target), _local_shards(value)
        if target_shards is not None:
            if value_shards is None or [s.tensor.shape for s in value_shards] != [s.tensor.shape
                                                                                  for s in target_shards]:
                problems.other.append(f"{name}: expected a ShardedTensor with local shards of shapes "
                                      f"{[tuple(s.tensor.shape) for s in target_shards]}")
        elif isinstance(target, Tensor):
            if not isinstance(value, Tensor) or value.shape != target.shape:
                given = tuple(value.shape) if isinstance(value, Tensor) else None
                problems.wrong_shape.append((name, given, tuple(target.shape)))


def _fresh_state(saved: Any, param: Tensor) -> State:
    """What a state with ``saved``'s keys looks like for ``param``: parameter-shaped tensors, scalars as saved."""
    if not isinstance(saved, Mapping):
        return {}
    return {key: (torch.empty(param.shape) if isinstance(value, Tensor) and value.dim() > 0 else value)
            for key, value in saved.items()}


def _copied(value: Any, target: Any) -> Any:
    """``value`` written into ``target`` in place when it is a tensor, else a copy of ``value``."""
    target_shards, value_shards = _local_shards(target), _local_shards(value)
    if target_shards is not None and value_shards is not None:  # checked: same local shard shapes
        for shard, source in zip(target_shards, value_shards, strict=True):
            shard.tensor.detach().copy_(source.tensor)
        return target
    if not isinstance(target, Tensor):
        return value.detach().clone() if isinstance(value, Tensor) else deepcopy(value)
    if isinstance(target, DTensor) and not isinstance(value, DTensor):
        # A full tensor into sharded state: each rank keeps its own part (no communication).
        value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements,
                                  src_data_rank=None)
    elif isinstance(value, DTensor) and not isinstance(target, DTensor):
        value = value.full_tensor()
    target.detach().copy_(value)
    return target


def _fsdp_problems(module: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> LoadProblems:
    """Unknown FQNs and wrong shapes in an FQN-keyed state dict for a classic FSDP ``module``."""
    entries = param_entries(module)
    shapes: dict[str, torch.Size] = {}
    for param in (p for group in optim.param_groups for p in group["params"]):
        entry = entries.get(id(param))
        if entry is None:
            continue
        if entry.handle is None:
            shapes[entry.fqns[0]] = param.shape
        else:
            slots = [entry.slot] if entry.slot is not None else range(len(entry.fqns))
            shapes.update(zip(entry.fqns, (entry.handle.layout.shapes[s] for s in slots), strict=True))
    problems = LoadProblems(unexpected=[f"state.{fqn}" for fqn in state_dict["state"] if fqn not in shapes])
    if problems.unexpected:
        problems.other.append(f"this optimizer holds {_listed(list(shapes))}: load a state dict saved from the "
                              "same model")
    for fqn, state in state_dict["state"].items():
        for key, value in (state.items() if fqn in shapes and isinstance(state, Mapping) else ()):
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != shapes[fqn]:
                problems.wrong_shape.append((f"state.{fqn}.{key}", tuple(value.shape), tuple(shapes[fqn])))
    return problems
