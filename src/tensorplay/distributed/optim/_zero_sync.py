"""How ZeRO brings every rank's updated parameters to every other rank.

Each rank owns some whole parameters. After its local update the owner
broadcasts them. The broadcasts are organised in *units* (some of one rank's
parameters, sent together) and *rounds* (unit ``k`` of every rank). With
``parameters_as_bucket_view`` each rank's trainable parameters live in one flat
buffer per (device, dtype) and a unit is a slice of it, so a unit is one
broadcast; without it, one broadcast per parameter.

[Note: pipelined step]
The local update of a rank's shard is memory-bound work that takes longer than
its broadcast on Gloo (measured on a loaded 2-core machine, 1 thread per rank:
Adam over 10M fp32 ~60-160 ms; broadcasting 2 x 40 MB between two ranks ~35 ms). With bucket views and a per-parameter optimizer,
each rank updates its unit ``k``, launches round ``k``'s broadcasts
asynchronously and goes on to unit ``k + 1``, so the transfer hides behind the
arithmetic. (With one broadcast per parameter this measured slower than
updating first, so that mode updates first.) The
arithmetic per parameter is unchanged (each parameter is stepped exactly once,
by the same optimizer code), so results stay bitwise equal to a single step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim import Optimizer

BucketKey = tuple[torch.device, torch.dtype]


@dataclass
class Unit:
    """Parameters of rank ``rank`` updated and broadcast together.

    ``flat`` is the 1D bucket slice that holds exactly these parameters, when
    they are bucketed; otherwise each parameter is broadcast on its own.
    """

    rank: int
    params: list[torch.Tensor]
    flat: torch.Tensor | None = None

    def broadcast(self, group: dist.ProcessGroup) -> list[dist.Work]:
        tensors = [self.flat] if self.flat is not None else [p.detach() for p in self.params]
        return [dist.broadcast(t, group=group, group_src=self.rank, async_op=True) for t in tensors]


def bucket_key(param: torch.Tensor) -> BucketKey:
    return param.device, param.dtype


class RankBuckets:
    """One flat buffer per (rank, device, dtype) holding that rank's parameters; the parameters become views.

    ``params_per_rank[r]`` lists rank ``r``'s trainable parameters; within a
    buffer they keep that order.
    """

    buffers: dict[BucketKey, list[torch.Tensor | None]]
    _offsets: dict[int, tuple[BucketKey, int]]

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]]) -> None:
        self.buffers = {}
        self._offsets = {}
        world = len(params_per_rank)
        for rank, params in enumerate(params_per_rank):
            for key, members in _by_key(params).items():
                self.buffers.setdefault(key, [None] * world)[rank] = self._pack(key, members)

    def _pack(self, key: BucketKey, params: list[torch.Tensor]) -> torch.Tensor:
        offset = 0
        for param in params:
            self._offsets[id(param)] = (key, offset)
            offset += param.numel()
        return pack_as_views(params)

    def slice_of(self, rank: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The flat slice covering ``params``, which must be consecutive in one of ``rank``'s buffers."""
        key, start = self._offsets[id(params[0])]
        buffer = self.buffers[key][rank]
        assert buffer is not None
        return buffer[start:start + sum(p.numel() for p in params)]

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._offsets


def pack_as_views(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1D buffer holding ``params`` (one device and dtype) end to end; each one's data becomes a view of it."""
    flat = torch.empty(sum(p.numel() for p in params), device=params[0].device, dtype=params[0].dtype)
    offset = 0
    for param in params:
        view = flat[offset:offset + param.numel()].view_as(param)
        view.copy_(param.detach())
        param.data = view
        offset += param.numel()
    return flat


def _by_key(params: Sequence[torch.Tensor]) -> dict[BucketKey, list[torch.Tensor]]:
    grouped: dict[BucketKey, list[torch.Tensor]] = {}
    for param in params:
        grouped.setdefault(bucket_key(param), []).append(param)
    return grouped


def split_units(rank: int, params: Sequence[torch.Tensor], unit_numel: int | None,
                buckets: RankBuckets | None) -> list[Unit]:
    """Cut ``rank``'s parameters into units of at least ``unit_numel`` elements (``None``: no cuts).

    With buckets a unit never spans two buffers, so it stays one contiguous slice.
    """
    groups = list(_by_key(params).values()) if buckets is not None else [list(params)]
    units: list[Unit] = []
    for members in groups:
        run: list[torch.Tensor] = []
        for param in members:
            run.append(param)
            if unit_numel is not None and sum(p.numel() for p in run) >= unit_numel:
                units.append(Unit(rank, run))
                run = []
        if run:
            units.append(Unit(rank, run))
    if buckets is not None:
        for unit in units:
            unit.flat = buckets.slice_of(rank, unit.params)
    return units


def rounds_of(units_per_rank: Sequence[Sequence[Unit]]) -> list[list[Unit]]:
    """Round ``k`` holds unit ``k`` of every rank that has one, in rank order (the same on every rank)."""
    depth = max((len(units) for units in units_per_rank), default=0)
    return [[units[k] for units in units_per_rank if k < len(units)] for k in range(depth)]


def wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()
    works.clear()


@contextmanager
def restricted_to(optim: Optimizer, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Let ``optim`` see only ``params`` in its groups for one step (see [Note: pipelined step])."""
    keep = {id(p) for p in params}
    saved = [group["params"] for group in optim.param_groups]
    try:
        for group in optim.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
        yield
    finally:
        for group, original in zip(optim.param_groups, saved):
            group["params"] = original
