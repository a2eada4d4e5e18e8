"""Collectives of picklable objects (rare: state-dict consolidation, a mismatch's full description).

Each is c10d's own call, recorded by the group's watch like every collective of
ours (so a rank elsewhere is named in the diagnosis and the fingerprints stay in
step), and the rank's status says it waits in it while it does. The call itself
blocks inside c10d, which bounds it by the group's timeout; the watch cannot
wait in slices there, so these are for the rare paths only, never a training
step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .collectives import _Watched

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object"]


def _begin(op: str, group: ProcessGroup | None, where: str | None,
           device: torch.device | None = None) -> tuple[_Watched, torch.Tensor]:
    placeholder = torch.empty(0, dtype=torch.uint8, device=device)  # the record's size: the same on every rank
    return _Watched.begin(op, placeholder, group, where), placeholder


def all_gather_object(gathered: list[Any], obj: Any, group: ProcessGroup | None = None, *,
                      where: str | None = None) -> None:
    """Every rank's ``obj`` into ``gathered`` (one slot per rank of ``group``, in rank order)."""
    watched, placeholder = _begin("all-gather of objects", group, where)
    with watched.blocking():
        dist.all_gather_object(gathered, obj, group=group)
    watched.done(placeholder, group, [], async_op=False)


def broadcast_object_list(objects: list[Any], group_src: int, group: ProcessGroup | None = None, *,
                          device: torch.device | None = None, where: str | None = None) -> None:
    """``objects`` of group rank ``group_src`` into ``objects`` on every rank of ``group``."""
    watched, placeholder = _begin(f"broadcast of objects from rank {group_src}", group, where, device)
    with watched.blocking():
        dist.broadcast_object_list(objects, group=group, group_src=group_src, device=device)
    watched.done(placeholder, group, [], async_op=False)


def gather_object(obj: Any, gathered: list[Any] | None, group_dst: int, group: ProcessGroup | None = None, *,
                  where: str | None = None) -> None:
    """Every rank's ``obj`` into ``gathered`` on group rank ``group_dst`` (``None`` on the others)."""
    watched, placeholder = _begin(f"gather of objects to rank {group_dst}", group, where)
    with watched.blocking():
        dist.gather_object(obj, gathered, group=group, group_dst=group_dst)
    watched.done(placeholder, group, [], async_op=False)
