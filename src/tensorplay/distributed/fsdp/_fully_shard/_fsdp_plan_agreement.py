"""fully_shard's plan agreement: the root checks, at lazy init, that every rank shards the same tree.

See [Note: plan agreement] in ``tensorplay.distributed._checks.plan_agreement``: one
small all-gather per process group the tree communicates over (one for a 1D
mesh), before the first all-gather, instead of a Gloo abort on a size mismatch.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._checks.plan_agreement import PlanEntry, check_plan_agreement

from ._fsdp_param_group import FSDPParamGroup


def check_tree_plan(root_modules: tuple[nn.Module, ...]) -> None:
    """Collective: every rank of the root's groups must shard the same parameters, shapes and dtypes."""
    per_group: dict[int, tuple[ProcessGroup, torch.device, list[PlanEntry]]] = {}
    for unit, group in _groups_by_fqn(root_modules):
        prefix = f"{unit}." if unit else ""
        entries = [PlanEntry(prefix + p.group_fqn, tuple(p.orig_size), str(p.orig_dtype),
                             f"shard dim {p.shard_dim} in the fully_shard group of '{unit or '<root>'}'")
                   for p in group.fsdp_params]
        for pg in (group.mesh_info.shard_group, group.mesh_info.replicate_group):
            if pg is not None:
                per_group.setdefault(id(pg), (pg, group.device, []))[2].extend(entries)
    what = f"fully_shard (first forward of the root {type(root_modules[0]).__name__})"
    for pg, device, entries in per_group.values():
        check_plan_agreement(entries, pg, what=what, device=device)


def _groups_by_fqn(root_modules: tuple[nn.Module, ...]) -> list[tuple[str, FSDPParamGroup]]:
    """Every fully_shard parameter group under the root once, with the FQN of its first module, in module order."""
    found: dict[int, tuple[str, FSDPParamGroup]] = {}
    for module in root_modules:
        for name, sub in module.named_modules():
            state = sub.__dict__.get("_fsdp_state")
            group = getattr(state, "group", None)
            if isinstance(group, FSDPParamGroup) and id(group) not in found:
                found[id(group)] = (name, group)
    return list(found.values())
