"""How ZeRO brings every rank's updated parameters to every other rank.

Each rank owns some whole parameters. After its local update the owner
broadcasts them. The broadcasts are organised in *units* (some of one rank's
parameters, sent together) and *rounds* (unit ``k`` of every rank). With
``parameters_as_bucket_view`` each rank's trainable parameters live in one flat
buffer per (device, dtype) and a unit is a slice of it, so a unit is one
broadcast; without it, one broadcast per large parameter and one per (device,
dtype) for the small ones (see [Note: small parameters]).

[Note: pipelined step]
The local update of a rank's shard is memory-bound work that takes about as
long as its broadcast on Gloo (2 ranks, 20M-parameter model, Adam: ~27 ms of
update and ~30 ms of transfer per step). With bucket views and a per-parameter
optimizer, each rank can update its unit ``k``, launch round ``k``'s broadcasts
asynchronously and go on to unit ``k + 1``, so the transfer hides behind the
arithmetic; the arithmetic per parameter is unchanged (each parameter is
stepped exactly once, by the same optimizer code), so results stay bitwise
equal. It only pays where each rank has a core to spare for the transfer: on a
loaded 2-core machine running 2 ranks, 4M-element units measured ~1.1x and 2M
~1.2x the unpipelined step, so it is off unless ``PIPELINE_UNIT_NUMEL`` is set
(``zero_redundancy_optimizer``). With one broadcast per parameter it measured
slower still, so it needs bucket views.

[Note: step errors ride on the broadcasts]
A rank whose local step raises must make every other rank raise too (see
[Note: errors must not strand peers] in ``_checks``). That needs no extra
collective where every rank sends a message of its own anyway: each bucket
buffer, and without bucket views each staging buffer of packed small
parameters, ends with one status element that its owner sets (0, or its
rank + 1 after a failed step) just before the message is broadcast, so every
rank reads every owner's outcome when the broadcasts are done (only whether
an element is non-zero counts: no dtype loses that). Where some rank sends no
such message (it owns no bucket, or only large parameters) a small agreement
after the broadcasts carries it instead; on the fake group's 16 small blocks
at 8 ranks that agreement and the per-parameter unpacking were most of the
step's cost above PyTorch's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.optim import Optimizer

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives
from tensorplay.distributed._sharding.layout import FlatLayout, flat_layout

BucketKey = tuple[torch.device, torch.dtype]


#: Without bucket views, parameters up to this many elements travel packed together
#: (see [Note: small parameters]).
SMALL_NUMEL = 1 << 16


@dataclass
class Packed:
    """Small parameters of one device and dtype, sent as one message through ``staging`` (1D): the parameters
    end to end, then one status element (see [Note: step errors ride on the broadcasts])."""

    params: list[torch.Tensor]
    staging: torch.Tensor
    layout: FlatLayout
    views: list[torch.Tensor] = field(init=False)  # each parameter's view of ``staging``, made once
    status: torch.Tensor = field(init=False)  # the status element (a 1-element view)

    def __post_init__(self) -> None:
        self.views = self.layout.views(self.staging)
        self._body, self.status = self.staging[: self.layout.numel], self.staging[self.layout.numel:]

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> Packed:
        layout = flat_layout([p.shape for p in params], world_size=1)
        return cls(params, params[0].new_zeros(layout.numel + 1), layout)

    def pack(self) -> None:
        torch.cat([p.detach().reshape(-1) for p in self.params], out=self._body)

    def unpack(self) -> None:
        """Copy the received parameters into place: one ``_foreach_copy_``, not a copy per parameter."""
        torch._foreach_copy_([p.detach() for p in self.params], self.views)


@dataclass
class Unit:
    """Parameters of rank ``rank`` updated and broadcast together.

    ``flat`` is the 1D bucket slice that holds exactly these parameters, when
    they are bucketed; otherwise the large ones are broadcast one by one and the
    small ones in ``packed`` messages.
    """

    rank: int
    params: list[torch.Tensor]
    flat: torch.Tensor | None = None
    packed: list[Packed] = field(default_factory=list)
    loose: list[torch.Tensor] = field(default_factory=list)  # not bucketed and in no pack: one broadcast each

    def broadcast(self, group: dist.ProcessGroup, my_rank: int) -> list[collectives.Pending]:
        if self.flat is not None:
            tensors = [self.flat]
        else:
            tensors = [p.detach() for p in self.loose]
            for pack in self.packed:
                if my_rank == self.rank:
                    pack.pack()
                tensors.append(pack.staging)
        where = f"ZeRO step, parameters of rank {self.rank}"
        return [collectives.broadcast(t, self.rank, group, async_op=True, where=where) for t in tensors]

    def finish(self, my_rank: int) -> None:
        """After the broadcasts: a receiver copies the packed small parameters into place."""
        if my_rank != self.rank:
            for pack in self.packed:
                pack.unpack()


def pack_small(params: Sequence[torch.Tensor]) -> list[Packed]:
    """[Note: small parameters] Each broadcast costs a round trip whatever its size (on a loaded
    Gloo machine ~1 ms), and biases and norms are many and tiny; without bucket views they go
    through a small staging buffer per (device, dtype) instead, copied in by the owner and out
    by the receivers."""
    small = [p for p in params if p.numel() <= SMALL_NUMEL]
    return [Packed.of(members) for members in _by_key(small).values() if len(members) > 1]


def bucket_key(param: torch.Tensor) -> BucketKey:
    return param.device, param.dtype


class RankBuckets:
    """One flat buffer per (rank, device, dtype) holding that rank's parameters; the parameters become views.

    ``params_per_rank[r]`` lists rank ``r``'s trainable parameters; within a
    buffer they keep that order. Each buffer ends with one status element
    after the parameters, which travels with the last unit of the buffer (see
    [Note: step errors ride on the broadcasts]).
    """

    buffers: dict[BucketKey, dict[int, torch.Tensor]]  # per key, only the ranks that have a buffer of it
    _offsets: dict[int, tuple[BucketKey, int]]

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]]) -> None:
        self.buffers = {}
        self._offsets = {}
        self.world = len(params_per_rank)
        for rank, params in enumerate(params_per_rank):
            for key, members in _by_key(params).items():
                self.buffers.setdefault(key, {})[rank] = self._pack(key, members)

    def _pack(self, key: BucketKey, params: list[torch.Tensor]) -> torch.Tensor:
        layout = flat_layout([p.shape for p in params], world_size=1)
        for param, offset in zip(params, layout.offsets, strict=True):
            self._offsets[id(param)] = (key, offset)
        return pack_as_views(params, layout, extra=1)

    def slice_of(self, rank: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The flat slice covering ``params``, which must be consecutive in one of ``rank``'s buffers
        (with the buffer's status element when they end the buffer)."""
        key, start = self._offsets[id(params[0])]
        buffer = self.buffers[key][rank]
        stop = start + sum(p.numel() for p in params)
        return buffer[start:stop + 1 if stop == buffer.numel() - 1 else stop]

    def status_slots(self, rank: int) -> list[torch.Tensor]:
        """The status element of each of ``rank``'s buffers (1-element views)."""
        return [buffer[-1:] for buffers in self.buffers.values() if (buffer := buffers.get(rank)) is not None]

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._offsets


class StepStatus:
    """The status elements of [Note: step errors ride on the broadcasts]: this rank's to set, the others' to read.

    ``rides``: every rank has one, so no agreement is needed.
    """

    def __init__(self, slots_per_rank: Sequence[Sequence[torch.Tensor]], rank: int) -> None:
        self.rides = all(slots_per_rank)
        self.rank = rank
        self._own = list(slots_per_rank[rank])
        #: The other ranks' elements per device (read with one kernel each), and whose each one is.
        self._peers: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        for owner, slots in enumerate(slots_per_rank):
            for slot in slots if owner != rank else ():
                ranks, flags = self._peers.setdefault(slot.device, ([], []))
                ranks.append(owner)
                flags.append(slot)

    @classmethod
    def of(cls, rounds: Sequence[Sequence[Unit]], buckets: RankBuckets | None, world: int, rank: int) -> StepStatus:
        """The elements of the buckets' buffers, or without bucket views of the packed small parameters."""
        if buckets is not None:
            return cls([buckets.status_slots(r) for r in range(world)], rank)
        slots: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for unit_round in rounds:
            for unit in unit_round:
                slots[unit.rank].extend(pack.status for pack in unit.packed)
        return cls(slots, rank)

    def set(self, error: BaseException | None) -> None:
        """Mark this rank's outcome in its elements (before they are broadcast)."""
        for slot in self._own:
            slot.fill_(0 if error is None else self.rank + 1)

    def failed_ranks(self) -> list[int]:
        """The other ranks whose elements say their step failed (after the broadcasts)."""
        failed: set[int] = set()
        for ranks, flags in self._peers.values():
            bad = torch.cat(flags).nonzero()
            if bad.numel():
                failed.update(ranks[i] for i in bad.view(-1).tolist())
        return sorted(failed)


def pack_as_views(params: Sequence[torch.Tensor], layout: FlatLayout | None = None, extra: int = 0) -> torch.Tensor:
    """One 1D buffer holding ``params`` (one device and dtype) end to end; each one's data becomes a view of it.

    ``layout``: ``params``' unpadded flat layout, when the caller already made it; ``extra``
    elements (zero) follow the parameters.
    """
    layout = layout if layout is not None else flat_layout([p.shape for p in params], world_size=1)
    flat = torch.zeros(layout.numel + extra, device=params[0].device, dtype=params[0].dtype) if extra else \
        torch.empty(layout.numel, device=params[0].device, dtype=params[0].dtype)
    for param, view in zip(params, layout.views(flat), strict=True):
        view.copy_(param.detach())
        param.data = view
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
    for unit in units:
        if buckets is not None:
            unit.flat = buckets.slice_of(rank, unit.params)
        else:
            unit.packed = pack_small(unit.params)
            in_packs = {id(p) for pack in unit.packed for p in pack.params}
            unit.loose = [p for p in unit.params if id(p) not in in_packs]
    return units


def rounds_of(units_per_rank: Sequence[Sequence[Unit]]) -> list[list[Unit]]:
    """Round ``k`` holds unit ``k`` of every rank that has one, in rank order (the same on every rank)."""
    depth = max((len(units) for units in units_per_rank), default=0)
    return [[units[k] for units in units_per_rank if k < len(units)] for k in range(depth)]


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
        for group, original in zip(optim.param_groups, saved, strict=True):
            group["params"] = original
