"""Plan agreement: before their first flat collective, the ranks check that they shard the same parameters.

[Note: plan agreement]
Flat collectives size their buffers from the local sharding plan. A rank that
built a different model (one layer wider, one parameter more) sends a buffer of
another size: Gloo then aborts the peer's process ("Received data size doesn't
match expected size", no Python exception) and NCCL hangs or reads garbage. So
each front end describes its plan as a list of :class:`PlanEntry` (name, shape,
dtype, and a free-form detail such as the unit or shard dim) and calls
:func:`check_plan_agreement` once, before its first collective. That costs one
agreement on a fixed-size digest (two int64 per rank, ``_comm.agreement.agree``,
see [Note: agreement]), watched like every collective of ours (a rank that is
elsewhere is named within the group's timeout instead of being waited on). Only
when the digests differ do the ranks exchange the full descriptions (``all_gather_object``), and
then every rank raises the same ``ValueError`` naming the ranks and the first
difference, so no rank is left blocked and no process aborts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup

from .._comm import objects
from .._comm.agreement import agree
from .._sharding.devices import collective_device

__all__ = ["PlanEntry", "check_plan_agreement", "collective_device", "first_difference", "param_group_entries",
           "plan_digest"]

class PlanEntry(NamedTuple):
    """One sharded tensor as this rank plans it: compared field by field across ranks."""

    name: str                 # FQN, or "param 3 of group 0" where there is none
    shape: tuple[int, ...]
    dtype: str
    detail: str = ""          # anything else the collectives depend on ("unit 'layers.0', shard dim 0")


EntryLike = PlanEntry | tuple


def as_entry(entry: EntryLike) -> PlanEntry:
    """``entry`` as a :class:`PlanEntry` with a plain-int shape and a string dtype."""
    if type(entry) is PlanEntry and type(entry.shape) is tuple:
        return entry
    name, shape, dtype, *rest = entry
    return PlanEntry(str(name), tuple(int(s) for s in shape), str(dtype), str(rest[0]) if rest else "")


def plan_digest(entries: Sequence[PlanEntry]) -> list[int]:
    """A 128-bit hash of ``entries`` as two signed int64 (equal plans give equal digests)."""
    text = "\n".join(map(repr, entries)).encode()
    raw = hashlib.blake2b(text, digest_size=16).digest()
    return [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)]


def check_plan_agreement(entries: Iterable[EntryLike], group: ProcessGroup | None = None, *, what: str,
                         device: torch.device | None = None) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless all of them pass equal ``entries``.

    Collective: call it on every rank of ``group``, before the collectives the
    plan sizes. ``what`` names the caller in the message ("fully_shard", ...).
    See [Note: plan agreement].
    """
    plan = [as_entry(entry) for entry in entries]
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = device if device is not None else collective_device(group)
    # A control collective: a rank elsewhere (say, in a load check) is named, not waited on.
    if not agree(f"{what} plan agreement", False, group, values=plan_digest(plan), device=device).differing():
        return
    plans: list[list[PlanEntry] | None] = [None] * world
    objects.all_gather_object(plans, plan, group, where=f"{what} plan agreement")
    raise ValueError(mismatch_message([list(map(as_entry, p or [])) for p in plans], _global_ranks(group, world),
                                      what))


def _global_ranks(group: ProcessGroup | None, world: int) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(world))
    return [dist.get_global_rank(group, r) for r in range(world)]


def mismatch_message(plans: list[list[PlanEntry]], ranks: list[int], what: str) -> str:
    """The error for ``plans`` (one per rank of the group, ``ranks`` their global ranks) that differ."""
    reference = plans[0]
    agree = [rank for rank, plan in zip(ranks, plans, strict=True) if plan == reference]
    differ = [(rank, plan) for rank, plan in zip(ranks, plans, strict=True) if plan != reference]
    first_rank, first_plan = differ[0]
    difference = first_difference(ranks[0], reference, first_rank, first_plan)
    return (f"{what}: the ranks' sharding plans differ, so their collectives would not match: {difference}. "
            f"Ranks {agree} agree with rank {ranks[0]}; ranks {[rank for rank, _ in differ]} differ. Every rank "
            f"must build the same model (same parameters, shapes and dtypes, in the same order) and apply the "
            f"same wrapping before its first collective")


def first_difference(ref_rank: int, reference: Sequence[PlanEntry], rank: int, other: Sequence[PlanEntry]) -> str:
    """The first place where ``other`` (rank ``rank``'s plan) differs from ``reference`` (``ref_rank``'s)."""
    ref_names = {entry.name for entry in reference}
    other_names = {entry.name for entry in other}
    for position, (ours, theirs) in enumerate(zip(reference, other, strict=False)):  # lengths may differ
        if ours == theirs:
            continue
        if ours.name == theirs.name:
            return _field_difference(ref_rank, ours, rank, theirs)
        if ours.name not in other_names:
            return _missing(rank, ours, ref_rank)
        if theirs.name not in ref_names:
            return _extra(rank, theirs, ref_rank)
        return (f"rank {rank} lists '{theirs.name}' at position {position} where rank {ref_rank} lists "
                f"'{ours.name}' (a different order)")
    if len(reference) > len(other):
        return _missing(rank, reference[len(other)], ref_rank)
    if len(other) > len(reference):
        return _extra(rank, other[len(reference)], ref_rank)
    return f"rank {rank}'s plan equals rank {ref_rank}'s"


def _field_difference(ref_rank: int, ours: PlanEntry, rank: int, theirs: PlanEntry) -> str:
    if ours.shape != theirs.shape:
        return f"rank {rank} has '{theirs.name}' of shape {theirs.shape}, rank {ref_rank} {ours.shape}"
    if ours.dtype != theirs.dtype:
        return f"rank {rank} has '{theirs.name}' of dtype {theirs.dtype}, rank {ref_rank} {ours.dtype}"
    return f"rank {rank} has '{theirs.name}' with {theirs.detail}, rank {ref_rank} with {ours.detail}"


def _missing(rank: int, entry: PlanEntry, ref_rank: int) -> str:
    return f"rank {rank} has no '{entry.name}', which rank {ref_rank} has (shape {entry.shape}, {entry.dtype})"


def _extra(rank: int, entry: PlanEntry, ref_rank: int) -> str:
    return (f"rank {rank} has an extra '{entry.name}' (shape {entry.shape}, {entry.dtype}), which rank "
            f"{ref_rank} does not have")


def param_group_entries(groups: Sequence[Sequence[torch.Tensor]]) -> list[PlanEntry]:
    """Entries for optimizer-style parameter groups (no FQNs): "param i of group g" with shape and dtype."""
    return [PlanEntry(f"param {i} of group {g}", tuple(p.shape), str(p.dtype),
                      f"requires_grad={p.requires_grad} on {p.device.type}")
            for g, params in enumerate(groups) for i, p in enumerate(params)]
