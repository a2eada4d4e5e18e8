"""All-or-nothing ``load_state_dict`` of classic FSDP: every key and shape is checked, on every rank, first.

See [Note: all-or-nothing loads] in ``_shard.load_check``. What a load expects
comes from a shape-only save: with ``UnitState.describing`` set, each unit's
state-dict hooks show meta placeholders of the shapes its state-dict type loads
(no gathering, nothing copied), so keys are exactly those ``load_state_dict``
walks, wrappers' renames included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist

from ..._shard.load_check import Expected, StateDictLoadError, agree_on_all_ranks, load_problems
from .state_dict import local_problem
from .unit_state import UnitState


def check_loadable(module: nn.Module, units: list[UnitState], state_dict: Mapping[str, Any], strict: bool,
                   groups: Sequence[dist.ProcessGroup]) -> None:
    """Raise on every rank, before anything is copied, if ``state_dict`` does not fit ``module`` on any rank.

    One error lists every missing, unexpected (both allowed when not ``strict``)
    and wrong-shape key with both shapes. Collective: one small all-reduce per
    group in ``groups`` (the root's shard and replicate groups).
    """
    expected, local_flats = _describe(module, units)
    problems = load_problems(expected, state_dict, strict=strict)
    for key, unit in local_flats.items():
        if key in state_dict and unit.handle is not None:
            problem = local_problem(unit.handle, state_dict[key], key)
            if problem is not None:
                problems.other.append(problem)
    where = type(module).__name__
    error: BaseException | None = StateDictLoadError(where, problems) if problems else None
    for group in groups:  # in stages (HYBRID: shard group, then replicate group), so every rank learns of any
        try:
            agree_on_all_ranks(error, where=where, group=group)
        except StateDictLoadError as raised:
            error = raised
    if error is not None:
        raise error


def unit_groups(units: list[UnitState]) -> list[dist.ProcessGroup]:
    """The shard and replicate groups of ``units``' plans, each once, in order: what a load agrees over."""
    groups: dict[int, dist.ProcessGroup] = {}
    for unit in units:
        for group in (unit.plan.shard_group, unit.plan.replicate_group):
            if group is not None:
                groups.setdefault(id(group), group)
    return list(groups.values())


def _describe(module: nn.Module, units: list[UnitState]) -> tuple[dict[str, Expected], dict[str, UnitState]]:
    """Every key ``module.load_state_dict`` expects with its shape, and which keys are local flat shards.

    A save in which the units show shape-only (meta) placeholders: nothing is
    gathered or copied, and wrappers' own state-dict hooks rename keys as usual.
    """
    flats: dict[int, UnitState] = {}
    for unit in units:
        unit.describing = flats
    try:
        described = module.state_dict(keep_vars=True)
    finally:
        for unit in units:
            unit.describing = None
    expected = {key: Expected(tuple(value.shape)) if isinstance(value, torch.Tensor) else Expected()
                for key, value in described.items()}
    local_flats = {key: flats[id(value)] for key, value in described.items() if id(value) in flats}
    for key in local_flats:
        expected[key] = Expected()  # a ShardedTensor or this rank's padded shard: see local_problem
    return expected, local_flats
