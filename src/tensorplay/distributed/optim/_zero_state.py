"""Translating between ZeRO's per-rank optimizer states and one ordinary full state dict.

A full state dict names parameters by the ids its ``param_groups`` list (in
order over the groups, as a plain optimizer over the same groups does). A
rank's local optimizer indexes only the parameters it owns, group by group, in
its own order. ``owned[r][g]`` (the positions within group ``g`` that rank
``r`` owns, in its local order) links the two, so a full dict saved at one
world size loads at any other.
"""

from __future__ import annotations

from typing import Any

import torch

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


def merge_local_states(full: StateDict, local_states: list[StateDict], owned: list[list[list[int]]]) -> StateDict:
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


def check_full_state_dict(full: Any, group_sizes: list[int]) -> None:
    """``full`` must describe exactly as many groups and parameters per group as this optimizer has."""
    if not isinstance(full, dict) or "state" not in full or "param_groups" not in full:
        raise ValueError("load_state_dict expects a full optimizer state dict with 'state' and 'param_groups' "
                         "(from consolidate_state_dict() then state_dict(), or a plain optimizer's state_dict())")
    saved_sizes = [len(group["params"]) for group in full["param_groups"]]
    if saved_sizes != group_sizes:
        raise ValueError(
            f"the state dict does not match this optimizer: it has {len(saved_sizes)} param group(s) with "
            f"{saved_sizes} parameters, this optimizer has {len(group_sizes)} with {group_sizes}; load a "
            f"checkpoint of the same model and param groups")
    listed = {index for group in full["param_groups"] for index in group["params"]}
    stray = [index for index in full["state"] if index not in listed]
    if stray:
        raise ValueError(f"the state dict holds state for parameter id(s) {stray[:5]} that none of its "
                         f"param_groups lists; it is not a complete optimizer state dict")


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
