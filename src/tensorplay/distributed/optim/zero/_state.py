"""Translating between ZeRO's per-rank optimizer states and one ordinary full state dict.

A full state dict names parameters by the ids its ``param_groups`` list (in
order over the groups, as a plain optimizer over the same groups does). A
rank's local optimizer indexes only the parameters it owns, group by group, in
its own order. ``owned[r][g]`` (the positions within group ``g`` that rank
``r`` owns, in its local order) links the two, so a full dict saved at one
world size loads at any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorplay.distributed._checks.load_check import LoadProblems

StateDict = dict[str, Any]


def to_device(value: Any, device: torch.device, copy: bool = False) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples) moved (or, with ``copy``, copied) to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=copy)
    if isinstance(value, dict):
        return {k: to_device(v, device, copy) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, copy) for v in value)
    return value


def local_state_dict(optim: Any) -> StateDict:
    """The local optimizer's state dict; built by hand for functional optimizers, which have none."""
    if hasattr(optim, "state_dict"):
        return optim.state_dict()
    params = [p for group in optim.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    groups, start = [], 0
    for group in optim.param_groups:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + count))})
        start += count
    state = {index[id(p)]: s for p, s in optim.state.items() if id(p) in index}
    return {"state": state, "param_groups": groups}


def merge_local_states(full: StateDict, local_states: list[StateDict], owned: Sequence[list[list[int]]]) -> StateDict:
    """Fill ``full["state"]`` (global indices) from every rank's local state dict."""
    for rank, local in enumerate(local_states):
        local_groups = local["param_groups"]
        if len(local_groups) != len(owned[rank]):
            raise RuntimeError(f"rank {rank}'s local optimizer has {len(local_groups)} param groups, "
                               f"expected {len(owned[rank])}; was add_param_group called on every rank?")
        for local_group, full_group, positions in zip(local_groups, full["param_groups"], owned[rank], strict=True):
            for local_index, position in zip(local_group["params"], positions, strict=True):
                if local_index in local["state"]:
                    full["state"][full_group["params"][position]] = local["state"][local_index]
    full["state"] = dict(sorted(full["state"].items()))
    return full


def full_state_problems(full: Any, groups: list[list[torch.Tensor]], elementwise: bool) -> LoadProblems:
    """Every way ``full`` does not fit an optimizer over ``groups`` (param groups' parameters).

    Checked: the layout (a dict with ``state`` and ``param_groups``, as many groups
    and parameters per group), state for ids no group lists, state entries that
    are not dicts, and, for an ``elementwise`` optimizer, every state tensor with
    dimensions against its parameter's shape (see [Note: all-or-nothing loads]).
    """
    problems = LoadProblems()
    if not isinstance(full, dict) or not isinstance(full.get("state"), dict) \
            or not isinstance(full.get("param_groups"), list) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in full["param_groups"]):
        problems.other.append(
            "expected a full optimizer state dict with 'state' and 'param_groups' (from consolidate_state_dict() "
            "then state_dict(), or a plain optimizer's state_dict())")
        return problems
    saved_sizes, sizes = [len(g["params"]) for g in full["param_groups"]], [len(g) for g in groups]
    if saved_sizes != sizes:
        problems.other.append(
            f"the state dict does not match this optimizer: it has {len(saved_sizes)} param group(s) with "
            f"{saved_sizes} parameters, this optimizer has {len(sizes)} with {sizes}; load a checkpoint of the "
            f"same model and param groups")
        return problems
    param_of = {index: param for saved, params in zip(full["param_groups"], groups, strict=True)
                for index, param in zip(saved["params"], params, strict=True)}
    for index, entry in full["state"].items():
        param = param_of.get(index)
        if param is None:
            problems.unexpected.append(f"state.{index} (no param group lists parameter id {index})")
        elif not isinstance(entry, dict):
            problems.other.append(f"state.{index} is a {type(entry).__name__}, not a dict of the parameter's state")
        elif elementwise:
            problems.wrong_shape.extend(
                (f"state.{index}.{name}", tuple(value.shape), tuple(param.shape)) for name, value in entry.items()
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape)
    return problems


def local_part(full: StateDict, owned: list[list[int]]) -> StateDict:
    """The local optimizer's state dict for a rank owning positions ``owned[g]`` of each group."""
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    local_index = 0
    for saved_group, positions in zip(full["param_groups"], owned, strict=True):
        params = []
        for position in positions:
            saved = full["state"].get(saved_group["params"][position])
            if saved is not None:
                state[local_index] = saved
            params.append(local_index)
            local_index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": params})
    return {"state": state, "param_groups": groups}
