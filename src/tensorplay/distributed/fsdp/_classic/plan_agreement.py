"""Classic FSDP's plan agreement: ranks check that they wrap the same units before the first collective.

See [Note: plan agreement] in ``tensorplay.distributed._shard.agreement``. The
root checks every unit once at lazy init (one small all-gather per process group
the units use: one unless HYBRID_SHARD); a unit built with
``sync_module_states=True`` checks its own parameters before those broadcasts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tensorplay.distributed import ProcessGroup

from ..._shard.agreement import PlanEntry, check_plan_agreement
from .param_views import ParamSlot
from .sharding_plan import ShardingPlan

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as Unit

_WRAPPED_PREFIX = "_fsdp_wrapped_module."


def check_units_plan(root: Unit, units: list[Unit]) -> None:
    """Collective: every rank must wrap the same units with the same parameters, shapes and dtypes."""
    names = {id(module): name.replace(_WRAPPED_PREFIX, "") for name, module in root.named_modules()}
    per_group: dict[int, tuple[ProcessGroup, list[PlanEntry]]] = {}
    for unit in units:
        handle = unit._handle
        if handle is None:
            continue
        unit_fqn = names.get(id(unit), "?")
        entries = _entries(handle.slots, list(handle.layout.shapes), handle.flat_param.dtype,
                           f"{unit_fqn}." if unit_fqn else "", f"unit '{unit_fqn or '<root>'}' "
                           f"({handle.plan.strategy.name})")
        for group in (handle.plan.shard_group, handle.plan.replicate_group):
            if group is not None:
                per_group.setdefault(id(group), (group, []))[1].extend(entries)
    what = f"FullyShardedDataParallel (first forward of the root wrapping {type(root.module).__name__})"
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
    return [PlanEntry(prefix + slot.fqn.replace(_WRAPPED_PREFIX, ""), tuple(shape), str(dtype), detail)
            for slot, shape in zip(slots, shapes, strict=True)]
