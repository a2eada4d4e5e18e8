"""Classic FSDP's plan agreement: ranks check that they wrap the same units before the first collective.

See [Note: plan agreement] in ``tensorplay.distributed._checks.plan_agreement``. The
root checks every unit once at lazy init (one small all-gather per process group
the units use: one unless HYBRID_SHARD); a unit built with
``sync_module_states=True`` checks its own parameters before those broadcasts.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorplay.distributed import ProcessGroup

from ..._checks.plan_agreement import PlanEntry, check_plan_agreement
from .param_views import ParamSlot
from .sharding_plan import ShardingPlan
from .unit_state import UnitState, clean_fqn


def check_units_plan(root_name: str, units: list[tuple[str, UnitState]]) -> None:
    """Collective: every rank must wrap the same units with the same parameters, shapes and dtypes.

    ``units``: every unit of the model with its FQN; ``root_name``: the class the root wraps.
    """
    per_group: dict[int, tuple[ProcessGroup, list[PlanEntry]]] = {}
    for unit_fqn, unit in units:
        handle = unit.handle
        if handle is None:
            continue
        entries = _entries(handle.slots, list(handle.layout.shapes), handle.flat_param.dtype,
                           f"{unit_fqn}." if unit_fqn else "", f"unit '{unit_fqn or '<root>'}' "
                           f"({handle.plan.strategy.name})")
        for group in (handle.plan.shard_group, handle.plan.replicate_group):
            if group is not None:
                per_group.setdefault(id(group), (group, []))[1].extend(entries)
    what = f"FullyShardedDataParallel (first forward of the root wrapping {root_name})"
    for group, entries in per_group.values():
        check_plan_agreement(entries, group, what=what)


def check_unit_plan(params: list[nn.Parameter], slots: list[ParamSlot], plan: ShardingPlan, unit_name: str) -> None:
    """Collective, at construction: this unit's parameters agree across ranks (before ``sync_module_states``)."""
    entries = _entries(slots, [p.shape for p in params], params[0].dtype if params else torch.float32, "",
                       f"unit {unit_name} ({plan.strategy.name})")
    for group in (plan.shard_group, plan.replicate_group):
        if group is not None:
            check_plan_agreement(entries, group, what=f"FullyShardedDataParallel({unit_name}) construction")


def _entries(slots: list[ParamSlot], shapes: list[torch.Size], dtype: torch.dtype, prefix: str,
             detail: str) -> list[PlanEntry]:
    return [PlanEntry(prefix + clean_fqn(slot.fqn), tuple(shape), str(dtype), detail)
            for slot, shape in zip(slots, shapes, strict=True)]
