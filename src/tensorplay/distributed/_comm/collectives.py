"""The flat collectives every front end uses, with the algorithm chosen per backend.

[Note: collectives on Gloo]
Gloo's native ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are much
slower than compositions of its other calls (measured, 32 MiB fp32, 1 thread per
rank, median ms; see docs/architecture.md):

    all-gather      native 46.5 (W=2) / 84 (W=4)  ->  one broadcast per rank: 9.4 / 31-35
    reduce-scatter  native 62.6 (W=2) / 143 (W=4) ->  all_reduce, keep own chunk (W=2): 35
                                                       one async reduce per rank (W>=3): 71
                                                       all_reduce (W>=3): the composed choice, see below
                                                       exchange (W=2): 20 (all_reduce: 56 that run)

"exchange" (two ranks): each rank sends the other its chunk and adds the one it
receives to its own: half the bytes of an all-reduce and one round trip; the sum
of two values is the same in either order, so it is bitwise equal to all_reduce.

From three ranks on, "all_reduce" all-reduces and keeps this rank's chunk:
Gloo's native reduce-scatter is an all-reduce too, so the sums are bitwise
the native ones (one reduce per rank sums in another order), and in
fully_shard at 4 ranks on 2 cores it used less CPU than one reduce per rank
in 3 of 3 side-by-side runs (0.71-0.75x PyTorch's vs 0.76-0.79x).

"shared_memory": when every rank of the group runs on this host, the bytes go
through a mapped file in /dev/shm instead of loopback TCP, with a byte through
a named pipe to each peer as the barrier (see [Note: shared-memory collectives]
in ``host_memory.py``; 4 MiB all-gather at 4 ranks on 2 cores: 1.2 ms against
4.7 for one broadcast per rank). Its reduce-scatter adds the ranks in the order
Gloo's ring all-reduce does, so it is bitwise the native one at every world
size. "composed" is "shared_memory" on one host; across hosts it is
"exchange" at two ranks and "all_reduce" from three on. All-reduces from 64 KiB
go through shared memory too (Gloo's order again; 4 MiB at 4 ranks: 2.7 ms
against Gloo's 7.2), past 4 MiB of rows (world x size) in pieces, as every rank
maps all the rows (resident memory); so do broadcasts from 64 KiB (one row,
written by the source: ZeRO's parameter broadcasts).

[Note: a group of one rank]
A group of one rank (one process; HSDP's replica group on a single node) has
nothing to exchange: an all-reduce or a broadcast leaves the tensor as it is, an
all-gather or a reduce-scatter is one copy, with no arena, barrier or watch
record (measured, classic NO_SHARD on one rank: the shared-memory path cost 10
ms of copies per step of 89). Gloo's results are the same values.

NCCL's native calls are the right choice on GPU. The choice lives in one table
(:data:`PLANS`), keyed by the backend that serves the tensor's device, and can
be overridden with :func:`set_collective_plan`.

Every collective here is recorded and checked by the group's watch (see
[Note: the collective watch] in ``watch.py``): ``where`` names the module or
parameter it serves (default: the enclosing :func:`watch.site`), ``state`` is a
small integer every rank must agree on (an averager's step), ``version`` a
counter that grows when the sent data change (the ranks must agree on whether
it changed since the last collective with the same ``where``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .host_memory import SMALL_BYTES, Barrier, HostArena, HostOp, all_reduce_now, arena_for, issue_all_reduce
from .watch import GroupWatch, Record, watch_for

AllGatherAlgo = Literal["native", "broadcast", "shared_memory"]
ReduceScatterAlgo = Literal["native", "all_reduce", "reduce", "exchange", "composed", "shared_memory"]
AllReduceAlgo = Literal["native", "shared_memory"]
BroadcastAlgo = Literal["native", "shared_memory"]


@dataclass(frozen=True)
class CollectivePlan:
    """How one backend runs the flat all-gather and reduce-scatter.

    ``reduce_scatter="composed"`` picks ``shared_memory`` when every rank is on this host, else ``exchange``
    for two ranks and ``all_reduce`` for more; all three are bitwise Gloo's (see [Note: collectives on Gloo]).
    """

    all_gather: AllGatherAlgo = "native"
    reduce_scatter: ReduceScatterAlgo = "native"
    all_reduce: AllReduceAlgo = "native"
    broadcast: BroadcastAlgo = "native"


PLANS: dict[str, CollectivePlan] = {
    "gloo": CollectivePlan(all_gather="shared_memory", reduce_scatter="composed", all_reduce="shared_memory",
                           broadcast="shared_memory"),
    "nccl": CollectivePlan(),
}


def set_collective_plan(backend: str, all_gather: AllGatherAlgo | None = None,
                        reduce_scatter: ReduceScatterAlgo | None = None,
                        all_reduce: AllReduceAlgo | None = None,
                        broadcast: BroadcastAlgo | None = None) -> CollectivePlan:
    """Override the plan for ``backend`` (e.g. ``set_collective_plan("gloo", all_gather="native")``)."""
    plan = PLANS.get(backend, CollectivePlan())
    if all_gather is not None:
        plan = replace(plan, all_gather=all_gather)
    if reduce_scatter is not None:
        plan = replace(plan, reduce_scatter=reduce_scatter)
    if all_reduce is not None:
        plan = replace(plan, all_reduce=all_reduce)
    if broadcast is not None:
        plan = replace(plan, broadcast=broadcast)
    PLANS[backend] = plan
    return plan


def backend_for(tensor: torch.Tensor, group: ProcessGroup | None) -> str:
    """The backend name that serves ``tensor``'s device in ``group`` ("gloo", "nccl", ...)."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    per_device = dict(item.split(":") for item in name.split(","))
    return per_device.get(tensor.device.type, next(iter(per_device.values())))


def plan_for(tensor: torch.Tensor, group: ProcessGroup | None) -> CollectivePlan:
    return PLANS.get(backend_for(tensor, group), CollectivePlan())


@dataclass
class Pending:
    """In-flight collective work; ``wait()`` blocks until it is done and finishes it.

    A watched collective waits in bounded slices and checks its fingerprint (see ``watch.py``).
    """

    works: list[Barrier] = field(default_factory=list)
    finish: Callable[[], None] | None = None
    watch: GroupWatch | None = None
    record: Record | None = None
    host_wait: bool = True  # CPU tensors: wait() blocks the host, so it can wait in bounded slices
    check: bool = False  # this collective carries a fingerprint: compare the ranks' once it is done
    drop: Callable[[], None] | None = None  # on discard(): make sure the result is never written

    def wait(self) -> None:
        watch, record = self.watch, self.record
        for work in self.works:
            if watch is None or record is None or not self.host_wait:
                work.wait()
            else:
                watch.wait_work(work, record)
        self.works.clear()
        if watch is not None and record is not None:
            self.watch = None
            if self.check:
                watch.verify(record.seq)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()

    def then(self, finish: Callable[[], None]) -> Pending:
        """This work, with ``finish`` run after its own finishing step (returns itself)."""
        first = self.finish

        def both() -> None:
            if first is not None:
                first()
            finish()

        self.finish = both
        return self

    def discard(self) -> None:
        """Wait for the work but skip its finishing steps (its result is not wanted)."""
        self.finish = None
        self.wait()
        if self.drop is not None:
            drop, self.drop = self.drop, None
            drop()


def wait_all(pendings: list[Pending]) -> None:
    """Wait for and finish each of ``pendings`` in order; the list is emptied."""
    for pending in pendings:
        pending.wait()
    pendings.clear()


@dataclass
class _Watched:
    """A collective's record with its group's watch, between issuing it and handing back its Pending."""

    watch: GroupWatch | None = None
    record: Record | None = None
    check: bool = False

    @classmethod
    def begin(cls, op: str, tensor: torch.Tensor, group: ProcessGroup | None, where: str | None,
              state: int = 0, version: int | None = None, always: bool = False) -> _Watched:
        watch = watch_for(group, lambda: backend_for(tensor, group))
        if watch is None:
            return cls()
        record = watch.begin(op, tensor, where, state, version)
        check = watch.fingerprint(record, always)  # before the data: when they arrive, every rank's is there
        return cls(watch, record, check)

    def verify(self) -> None:
        """Compare the fingerprints once the data arrived, if this collective carries one (see ``watch.py``)."""
        if self.check and self.watch is not None and self.record is not None:
            self.watch.verify(self.record.seq)

    def wait_work(self, work: Barrier) -> None:
        """Wait for ``work`` as this collective's Pending would (in the watch's slices when watched)."""
        if self.watch is None or self.record is None:
            work.wait()
        else:
            self.watch.wait_work(work, self.record)

    def done(self, tensor: torch.Tensor, group: ProcessGroup | None, works: list,
             finish: Callable[[], None] | None = None, async_op: bool = True) -> Pending:
        pending = Pending([w for w in works if w is not None], finish, self.watch, self.record,
                          tensor.device.type == "cpu", self.check)
        if not async_op:
            pending.wait()
        return pending

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a c10d call that blocks by itself (the object collectives): the rank says it waits in it."""
        if self.watch is None or self.record is None:
            yield
            return
        self.watch.waiting = self.record
        try:
            yield
        finally:
            self.watch.waiting = None

    def done_in_host_memory(self, tensor: torch.Tensor, group: ProcessGroup | None, op: HostOp,
                            async_op: bool) -> Pending:
        """The Pending of a shared-memory operation: waiting reads its result; discarding never writes it."""
        pending = self.done(tensor, group, [op.barrier], op.finish, async_op=True)
        pending.drop = op.drop
        if not async_op:
            pending.wait()
        return pending


class ScratchPool(Protocol):
    """Lends the temporary buffers of :class:`GatherParts` and :class:`ScatterParts` (e.g. ``BufferPool``)."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def give(self, buffer: torch.Tensor) -> None: ...


def _borrow(pool: ScratchPool | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    return pool.take(numel, like.dtype, like.device) if pool is not None else like.new_empty(numel)


def _give_back(pool: ScratchPool | None, buffer: torch.Tensor) -> None:
    if pool is not None:
        pool.give(buffer)


@dataclass
class GatherParts:
    """An all-gather's output as separate destinations instead of one buffer.

    ``parts`` holds ``(offset, destination)``: columns ``[offset, offset + n)`` of every rank's shard go to
    ``destination``, a ``(world, n)`` tensor (rank r's columns in row r). Through shared memory they are
    copied there straight from the slot; otherwise through a temporary buffer. Written without autograd
    and without bumping the destinations' version counters (they are parameters' storage), unless
    ``own_versions`` says the destinations carry counters of their own (``.data`` aliases): then the writes
    need no guard, which costs more than the copy for small parameters.
    """

    parts: list[tuple[int, torch.Tensor]]
    pool: ScratchPool | None = None  # lends the temporary buffer where there is one
    own_versions: bool = False
    #: The parts' widths when they tile ``[0, sum)`` in order, all in one dtype (the usual case), else None.
    tiling: list[int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        widths, cursor = [], 0
        self._targets = [destination for _, destination in self.parts]
        for offset, destination in self.parts:
            if offset != cursor or destination.dtype != self._targets[0].dtype:
                return
            widths.append(destination.shape[1])
            cursor += destination.shape[1]
        self.tiling, self._columns = widths, cursor

    def write(self, begin: int, end: int, rows: torch.Tensor) -> None:
        """Columns ``[begin, end)`` of every rank's shard, ``rows`` being ``(world, end - begin)``.

        The whole of a tiling at once is one ``split_with_sizes_copy``; a range of it one ``_foreach_copy_``:
        the per-part Python (a slice, a version-counter guard, a copy) was most of an all-gather's host time
        for groups of small parameters.
        """
        targets = self._targets
        if self.tiling and begin == 0 and end == self._columns == rows.shape[1] \
                and rows.dtype == targets[0].dtype:  # (a copy_ would cast, this does not)
            self._unversioned(targets, functools.partial(torch.split_with_sizes_copy, rows, self.tiling, dim=1,
                                                         out=targets))
            return
        targets, sources = [], []
        for offset, destination in self.parts:
            width = destination.shape[1]
            low, high = max(begin, offset), min(end, offset + width)
            if low < high:
                whole = low == offset and high == offset + width
                targets.append(destination if whole else destination[:, low - offset:high - offset])
                sources.append(rows[:, low - begin:high - begin])
        if targets:
            self._unversioned(targets, functools.partial(torch._foreach_copy_, targets, sources))

    def _unversioned(self, targets: list[torch.Tensor], copy: Callable[[], object]) -> None:
        """Run ``copy`` (into ``targets``) without autograd and without changing their version counters."""
        if self.own_versions:
            copy()
            return
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
            copy()


@dataclass
class ScatterParts:
    """A reduce-scatter's input as separate sources instead of one buffer (the mirror of :class:`GatherParts`).

    :attr:`parts` holds ``(offset, source)``: ``source`` (``(world, n)``, any strides and dtype) gives columns
    ``[offset, offset + n)`` of every rank's chunk of the input; together they cover all ``columns`` of a
    chunk. Through shared memory they are copied straight into the slots (cast to ``dtype``); otherwise into
    a temporary buffer first (by :attr:`pack` where there is one: then the parts are never made).
    """

    #: The parts, or what makes them on first use: a view per source is Python work per parameter, wasted
    #: where :attr:`pack` writes the whole input at once.
    sources: list[tuple[int, torch.Tensor]] | Callable[[], list[tuple[int, torch.Tensor]]]
    columns: int
    dtype: torch.dtype
    #: Writes the whole input into a ``(world, columns)`` buffer at once (one kernel), where it is faster than
    #: :meth:`write` part by part.
    pack: Callable[[torch.Tensor], None] | None = None
    pool: ScratchPool | None = None  # lends the temporary buffer where there is one
    device: torch.device | None = None  # the buffer's (None: the first source's)

    @property
    def parts(self) -> list[tuple[int, torch.Tensor]]:
        # Made on first use. A plain property: a cached_property is called from functools, across the boundary.
        sources = self.sources
        if callable(sources):
            sources = self.sources = sources()
        return sources

    def write(self, begin: int, end: int, row: torch.Tensor) -> None:
        """Columns ``[begin, end)`` of every rank's chunk into ``row`` (``(world, end - begin)``)."""
        for offset, source in self.parts:
            low, high = max(begin, offset), min(end, offset + source.shape[1])
            if low < high:
                row[:, low - begin:high - begin].copy_(source[:, low - offset:high - offset])

    def buffer(self, world: int) -> torch.Tensor:
        """The whole input in one 1D buffer (borrowed from :attr:`pool` when there is one)."""
        device = self.device if self.device is not None else self.parts[0][1].device
        flat = self.pool.take(world * self.columns, self.dtype, device) if self.pool is not None else \
            torch.empty(world * self.columns, dtype=self.dtype, device=device)
        full = flat.view(world, self.columns)
        if self.pack is not None:
            self.pack(full)
        else:
            self.write(0, self.columns, full)
        return flat


@dataclass
class FlatParts:
    """A reduce-scatter's 1D input as pieces at offsets in it (the rest zero), divided by ``divide`` on the way in.

    ``parts`` holds ``(offset, source)``, 1D sources in increasing, non-overlapping offsets; the input has
    ``world x columns`` elements of ``dtype`` on ``device``. Like :class:`ScatterParts`, through shared
    memory the pieces are written straight into the slots; otherwise into a temporary buffer first.
    Dividing while copying gives the same values as dividing the whole input in place first; sources in
    another dtype are cast to ``dtype`` first (a gradient reduced in a wider ``reduce_dtype``).
    """

    parts: list[tuple[int, torch.Tensor]]
    columns: int
    dtype: torch.dtype
    device: torch.device
    divide: float = 1.0

    def write(self, begin: int, end: int, row: torch.Tensor) -> None:
        """Columns ``[begin, end)`` of every rank's chunk into ``row`` (``(world, end - begin)``)."""
        for rank in range(row.shape[0]):
            self._write_range(rank * self.columns + begin, rank * self.columns + end, row[rank])

    def _write_range(self, low: int, high: int, out: torch.Tensor) -> None:
        """Elements ``[low, high)`` of the input into ``out``."""
        done = low
        for offset, source in self.parts:
            start, stop = max(done, offset), min(high, offset + source.numel())
            if start >= stop:
                continue
            if start > done:  # a gap (a parameter without a gradient)
                out[done - low:start - low].zero_()
            piece, into = source[start - offset:stop - offset], out[start - low:stop - low]
            if self.divide != 1 and piece.dtype == into.dtype:
                torch.div(piece, self.divide, out=into)
            else:  # cast first, then divide in the input's dtype: as casting the whole input and dividing it
                into.copy_(piece)
                if self.divide != 1:
                    into.div_(self.divide)
            done = stop
        if done < high:  # the padding, or a parameter without a gradient
            out[done - low:].zero_()

    def buffer(self, world: int) -> torch.Tensor:
        """The whole input in one fresh 1D buffer: each part copied (and divided) once, the gaps zeroed.

        One pass over the parts, not one per rank as :meth:`write` makes: at thousands of ranks a per-rank loop
        in Python would cost more than the copy itself.
        """
        flat = torch.empty(world * self.columns, dtype=self.dtype, device=self.device)
        self._write_range(0, flat.numel(), flat)
        return flat


def all_gather_flat(output: torch.Tensor | GatherParts, shard: torch.Tensor, group: ProcessGroup | None = None,
                    async_op: bool = False, *, where: str | None = None, version: int | None = None) -> Pending:
    """Gather every rank's 1D ``shard`` into ``output`` (1D, ``world_size * shard.numel()``), in rank order.

    ``output`` may also be :class:`GatherParts`: the result goes straight into those destinations.
    """
    world = dist.get_world_size(group)
    parts = output if isinstance(output, GatherParts) else None
    if isinstance(output, torch.Tensor) and output.numel() != world * shard.numel():
        raise ValueError(f"all_gather_flat: output has {output.numel()} elements, expected "
                         f"{world} ranks x {shard.numel()}")
    if world == 1:  # see [Note: a group of one rank]
        if isinstance(output, GatherParts):
            output.write(0, shard.numel(), shard.view(1, -1))
        else:
            _copy_unless_same(output, shard)
        return Pending()
    watched = _Watched.begin("all-gather", shard, group, where, version=version)
    algo = plan_for(shard, group).all_gather
    arena = _host_arena(shard, group, watched) if algo == "shared_memory" else None
    if parts is not None and arena is not None:
        op = arena.all_gather_into(parts.write, shard, watched.wait_work)
        if op is not None:
            return watched.done_in_host_memory(shard, group, op, async_op)
    buffer = output if isinstance(output, torch.Tensor) else _borrow(output.pool, world * shard.numel(), shard)
    finish = None if parts is None else lambda: _land(parts, buffer, world)
    if algo == "native":
        return watched.done(shard, group, [dist.all_gather_single(buffer, shard, group=group, async_op=True)],
                            finish, async_op)
    op = arena.all_gather(buffer, shard, watched.wait_work) if arena is not None and parts is None else None
    if op is not None:
        return watched.done_in_host_memory(shard, group, op, async_op)
    chunks = buffer.view(world, -1)
    chunks[dist.get_rank(group)].copy_(shard)
    works = [dist.broadcast(chunks[r], group=group, group_src=r, async_op=True) for r in range(world)]
    return watched.done(shard, group, works, finish, async_op)


def _land(parts: GatherParts, buffer: torch.Tensor, world: int) -> None:
    """Copy a gathered ``buffer`` into ``parts``' destinations and give it back."""
    parts.write(0, buffer.numel() // world, buffer.view(world, -1))
    _give_back(parts.pool, buffer)


def reduce_scatter_flat(shard_out: torch.Tensor, full: torch.Tensor | ScatterParts | FlatParts,
                        group: ProcessGroup | None = None, async_op: bool = False, *,
                        where: str | None = None) -> Pending:
    """Sum ``full`` (1D, ``world_size * shard_out.numel()``) across ranks; keep this rank's chunk in ``shard_out``.

    ``full`` is used as scratch and holds garbage afterwards. It may also be :class:`ScatterParts` or
    :class:`FlatParts`: through shared memory their sources are staged straight into the slots, with no
    buffer of the whole input.
    """
    world = dist.get_world_size(group)
    parts = None if isinstance(full, torch.Tensor) else full
    if world == 1 and parts is not None:  # see [Note: a group of one rank]
        parts.write(0, parts.columns, shard_out.view(1, -1))
        return Pending()
    if world == 1 and isinstance(full, torch.Tensor) and full.numel() == shard_out.numel():
        _copy_unless_same(shard_out, full)
        return Pending()
    if parts is not None:  # numel and dtype for the plan and the watch, no memory
        full = torch.empty(1, dtype=parts.dtype, device=shard_out.device).expand(world * parts.columns)
    assert isinstance(full, torch.Tensor)
    if full.numel() != world * shard_out.numel():
        raise ValueError(f"reduce_scatter_flat: input has {full.numel()} elements, expected "
                         f"{world} ranks x {shard_out.numel()}")
    algo = plan_for(full, group).reduce_scatter
    watched = _Watched.begin("reduce-scatter", full, group, where)
    if algo in ("shared_memory", "composed"):
        arena = _host_arena(full, group, watched)
        op = None
        if arena is not None:
            op = (arena.reduce_scatter_from(parts.write, shard_out, parts.dtype, watched.wait_work) if parts
                  else arena.reduce_scatter(shard_out, full, watched.wait_work))
        if op is not None:
            return watched.done_in_host_memory(full, group, op, async_op)  # the input was staged on issue
        algo = "exchange" if world == 2 else "all_reduce"  # ranks on several hosts, or no room in /dev/shm
    if parts is None:
        return _reduce_scatter_buffer(shard_out, full, group, algo, watched, async_op)
    full = parts.buffer(world)
    pending = _reduce_scatter_buffer(shard_out, full, group, algo, watched, async_op=True)
    pool = parts.pool if isinstance(parts, ScatterParts) else None
    pending.then(functools.partial(_give_back, pool, full))
    if not async_op:
        pending.wait()
    return pending


def _reduce_scatter_buffer(shard_out: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None, algo: str,
                           watched: _Watched, async_op: bool) -> Pending:
    """:func:`reduce_scatter_flat` of a 1D input buffer by ``algo``, on Gloo's or NCCL's own calls."""
    if algo == "native":  # before the rank and world lookups, which only the composed ones need
        work = dist.reduce_scatter_single(shard_out, full, group=group, async_op=True)
        return watched.done(full, group, [work], async_op=async_op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = full.view(world, -1)

    def keep_own_chunk() -> None:
        shard_out.copy_(chunks[rank])

    if algo == "all_reduce":
        work = dist.all_reduce(full, group=group, async_op=True)
        return watched.done(full, group, [work], keep_own_chunk, async_op)
    if algo == "exchange":
        return watched.done(full, group, *_exchange(shard_out, chunks, rank, group), async_op=async_op)
    works = [dist.reduce(chunks[r], group=group, group_dst=r, async_op=True) for r in range(world)]
    return watched.done(full, group, works, keep_own_chunk, async_op)


def _host_arena(tensor: torch.Tensor, group: ProcessGroup | None, watched: _Watched) -> HostArena | None:
    """The shared-memory arena for ``tensor``'s collectives in ``group`` (None: not a CPU tensor, or several hosts)."""
    if tensor.device.type != "cpu":
        return None
    return arena_for(group if group is not None else dist.distributed_c10d._get_default_group(), watched.wait_work)


def _copy_unless_same(destination: torch.Tensor, source: torch.Tensor) -> None:
    """``destination`` = ``source`` (the same number of elements), unless they are the same memory already."""
    if destination.data_ptr() != source.data_ptr():
        destination.view(-1).copy_(source.view(-1))


def _exchange(shard_out: torch.Tensor, chunks: torch.Tensor, rank: int,
              group: ProcessGroup | None) -> tuple[list, Callable[[], None]]:
    """Two ranks' reduce-scatter: send the peer its chunk, receive ours, add (see [Note: collectives on Gloo])."""
    inside = chunks.numel() and shard_out.untyped_storage().data_ptr() == chunks.untyped_storage().data_ptr()
    if inside or not shard_out.is_contiguous():
        received = torch.empty_like(chunks[rank])  # the output is inside the input (or strided): receive elsewhere
    else:
        received = shard_out
    peer = 1 - rank
    works = [dist.isend(chunks[peer], group=group, group_dst=peer),
             dist.irecv(received, group=group, group_src=peer)]

    def add_own_chunk() -> None:
        torch.add(received, chunks[rank], out=shard_out)

    return works, add_own_chunk


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False, *,
               where: str | None = None, state: int = 0, fingerprint: bool = False,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending:
    """Reduce ``tensor`` in place across ``group`` by ``op`` (a sum unless told; ``fingerprint``: always check
    it, for rare collectives). Only sums go through shared memory; other ops are the backend's own."""
    if dist.get_world_size(group) == 1:  # see [Note: a group of one rank]
        return Pending()
    watched = _Watched.begin("all-reduce" if op == dist.ReduceOp.SUM else f"all-reduce ({op})", tensor, group,
                             where, state, always=fingerprint)
    if op == dist.ReduceOp.SUM and _sum_in_host_memory(tensor, group):
        host_op = issue_all_reduce(_resolved(group), tensor, watched.wait_work)
        if host_op is not None:
            return watched.done_in_host_memory(tensor, group, host_op, async_op)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return watched.done(tensor, group, [work], async_op=async_op)


def _sum_in_host_memory(tensor: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether the plan sends a sum of ``tensor`` in ``group`` through shared memory: the one question a sum
    asks (whether the group has an arena with room, the transport answers when it is given the work)."""
    return (tensor.device.type == "cpu" and plan_for(tensor, group).all_reduce == "shared_memory"
            and tensor.is_floating_point() and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() >= SMALL_BYTES)


def _resolved(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def all_reduce_future(tensor: torch.Tensor, group: ProcessGroup | None = None, *,
                      where: str | None = None) -> torch.futures.Future[torch.Tensor]:
    """Sum ``tensor`` in place across ``group``; a future that resolves to ``tensor`` (for DDP comm hooks).

    Through shared memory the sum is done before this returns (the future is complete: it costs less CPU
    than Gloo's loopback copies, which on the CPU run beside backward anyway), in one call into the
    transport; otherwise the native call's.
    """
    if dist.get_world_size(group) == 1:  # see [Note: a group of one rank]
        return _completed(tensor)
    watched = _Watched.begin("all-reduce", tensor, group, where)
    if _sum_in_host_memory(tensor, group) and all_reduce_now(_resolved(group), tensor, watched.wait_work):
        watched.verify()
        return _completed(tensor)
    return _native_all_reduce_future(watched, tensor, group).then(lambda fut: fut.value()[0])


def watched_all_reduce_future(tensor: torch.Tensor, group: ProcessGroup | None = None, *,
                              where: str | None = None) -> torch.futures.Future[list[torch.Tensor]]:
    """The native all-reduce's future (a list holding ``tensor``), for DDP comm hooks, watched.

    Recorded by the group's watch like every collective of ours. On the CPU its wait is bounded so that a
    diagnosis still fits in the group's timeout, and a failure (a peer elsewhere, dead or gone) becomes a
    :class:`CollectiveDivergence` naming every rank's collective instead of Gloo's own error.
    """
    return _native_all_reduce_future(_Watched.begin("all-reduce", tensor, group, where), tensor, group)


def _native_all_reduce_future(watched: _Watched, tensor: torch.Tensor,
                              group: ProcessGroup | None) -> torch.futures.Future[list[torch.Tensor]]:
    if watched.watch is None or tensor.device.type != "cpu":
        work = dist.all_reduce(tensor, group=group, async_op=True)
        assert work is not None
        return work.get_future()
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    options.timeout = timedelta(seconds=max(0.05, watched.watch.final_after_s()))
    started = time.monotonic()
    future = _resolved(group).allreduce([tensor], options).get_future()
    watched.watch.hold(future)
    return future.then(functools.partial(_named_failure, watched, started))


def _named_failure(watched: _Watched, started: float, future: torch.futures.Future) -> list[torch.Tensor]:
    """The future's value; its error diagnosed by the watch (a CollectiveDivergence naming every rank)."""
    try:
        return future.value()
    except RuntimeError as error:
        if watched.watch is not None and watched.record is not None:
            watched.watch.diagnose(watched.record, error, stalled_s=time.monotonic() - started, final=True)
        raise


def broadcast(tensor: torch.Tensor, group_src: int, group: ProcessGroup | None = None,
              async_op: bool = False, *, where: str | None = None, state: int = 0) -> Pending:
    """Broadcast ``tensor`` from group rank ``group_src`` to every rank of ``group``."""
    if dist.get_world_size(group) == 1:  # see [Note: a group of one rank]
        return Pending()
    watched = _Watched.begin(f"broadcast from rank {group_src}", tensor, group, where, state)
    if (plan_for(tensor, group).broadcast == "shared_memory" and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() >= SMALL_BYTES):
        arena = _host_arena(tensor, group, watched)
        op = arena.broadcast(tensor, group_src, watched.wait_work) if arena is not None else None
        if op is not None:
            return watched.done_in_host_memory(tensor, group, op, async_op)
    return watched.done(tensor, group, [dist.broadcast(tensor, group=group, group_src=group_src, async_op=True)],
                        async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], group: ProcessGroup | None = None, async_op: bool = False, *,
                      where: str | None = None, count: int | None = None) -> Pending:
    """Send ``input``'s ``input_split_sizes`` pieces of the 1D input to the ranks in order; receive theirs
    into ``output`` (``output_split_sizes``, also in rank order).

    The pieces' sizes differ per rank, so the watch records ``count`` elements (a number every rank agrees on,
    e.g. the matrices exchanged) instead of the input's; without it, the input's size.
    """
    if dist.get_world_size(group) == 1:  # see [Note: a group of one rank]
        _copy_unless_same(output, input)
        return Pending()
    record = input if count is None else input.new_empty(count)
    watched = _Watched.begin("all-to-all", record, group, where)
    work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=True)
    return watched.done(record, group, [work], async_op=async_op)


def all_gather_future(tensor: torch.Tensor, group: ProcessGroup | None = None, *,
                      where: str | None = None) -> tuple[list[torch.Tensor], torch.futures.Future]:
    """Gather every rank's ``tensor`` (same shape on each): the list it fills, in rank order, and the future of
    the work (for DDP comm hooks, which chain on it). Recorded by the group's watch."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    watched = _Watched.begin("all-gather", tensor, group, where)
    work = dist.all_gather(gathered, tensor, group=group, async_op=True)
    assert work is not None
    future = work.get_future()
    if watched.watch is not None:
        watched.watch.hold(future)
    return gathered, future
