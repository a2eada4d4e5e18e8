"""All-or-nothing ``load_state_dict`` of classic FSDP: every key and shape is checked, on every rank, first.

See [Note: all-or-nothing loads] in ``_checks.load_check``. What a load expects
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
from tensorplay.distributed.tensor import DTensor

from ..._checks.load_check import (
    Expected,
    StateDictLoadError,
    agree_on_all_ranks,
    dtensor_problems,
    load_problems,
    local_shard_problem,
    with_sharding_hint,
)
from ..._sharding.layout import rank_slice
from ..api import StateDictType
from .state_dict import _effective_type, _shard_group, local_problem
from .unit_state import UnitState


def check_loadable(module: nn.Module, units: list[UnitState], state_dict: Mapping[str, Any], strict: bool,
                   groups: Sequence[dist.ProcessGroup]) -> None:
    """Raise on every rank, before anything is copied, if ``state_dict`` does not fit ``module`` on any rank.

    One error lists every missing, unexpected (both allowed when not ``strict``)
    and wrong-shape key with both shapes. Collective: one small all-reduce per
    group in ``groups`` (the root's shard and replicate groups).
    """
    expected, local_flats, sharded, described = _describe(module, units)
    problems = load_problems(expected, state_dict, strict=strict)
    for key, unit in local_flats.items():
        if key in state_dict and unit.handle is not None:
            problem = local_problem(unit.handle, state_dict[key], key)
            if problem is not None:
                problems.other.append(problem)
    for key, unit in sharded.items():
        shape = expected[key].shape
        if key in state_dict and shape is not None and tuple(getattr(state_dict[key], "shape", ())) == shape:
            problem = _shard_problem(unit, key, state_dict[key], shape)
            if problem is not None:
                problems.other.append(problem)
    problems.other.extend(dtensor_problems(described, state_dict))  # fully_shard modules in the same tree
    problems.other = with_sharding_hint(problems.other)
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


def _shard_problem(unit: UnitState, key: str, value: Any, shape: tuple[int, ...]) -> str | None:
    """Why a sharded-state-dict value does not fit ``unit``'s load (None: it does, or it is a plain tensor).

    A ``ShardedTensor``'s shards are placed by their offsets and summed over the
    shard group, so they must be this rank's dim-0 chunk there; a ``DTensor`` is
    gathered over its own mesh, so it only has to hold what its placements say.
    """
    if isinstance(value, DTensor):
        return local_shard_problem(key, value, None, "", dist.get_rank())
    assert unit.handle is not None
    group = _shard_group(unit.handle)
    world, member = dist.get_world_size(group), dist.get_rank(group)
    want: list[tuple[tuple[int, ...], tuple[int, ...]]]
    if not shape:
        want = [((), ())]
    else:
        part = rank_slice(shape[0], world, member)
        want = [((part.start, *[0] * (len(shape) - 1)), (part.size, *shape[1:]))]
    how = f"dim-0 chunk {member} of {world} in this unit's shard group"
    return local_shard_problem(key, value, want, how, dist.get_rank())


def _describe(module: nn.Module, units: list[UnitState]
              ) -> tuple[dict[str, Expected], dict[str, UnitState], dict[str, UnitState], dict[str, Any]]:
    """Every key ``module.load_state_dict`` expects with its shape; which keys are local flat shards, which are
    parameters of sharded-state-dict units (and their units); and the described values themselves.

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
    owners = {key: flats[id(value)] for key, value in described.items() if id(value) in flats}
    local_flats = {k: u for k, u in owners.items() if _effective_type(u) is StateDictType.LOCAL_STATE_DICT}
    sharded = {k: u for k, u in owners.items() if _effective_type(u) is StateDictType.SHARDED_STATE_DICT}
    for key in local_flats:
        expected[key] = Expected()  # a ShardedTensor or this rank's padded shard: see local_problem
    return expected, local_flats, sharded, described
