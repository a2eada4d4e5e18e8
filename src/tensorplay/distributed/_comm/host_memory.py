"""Flat all-gather and reduce-scatter through memory that every rank on one host maps.

[Note: shared-memory collectives]
Gloo moves every byte through loopback TCP: a copy into the kernel and one out,
per peer, on the CPU. When all ranks of a group run on one host they can
instead map one file in ``/dev/shm`` (``torch.from_file(..., shared=True)``):

    all-gather      each rank copies its shard into its chunk of a slot; after
                    the barrier (a byte to each peer through a named pipe, see
                    [Note: the pipe barrier] in ``host_barrier.py``; a
                    one-element Gloo all-reduce when pipes can't be made), each
                    copies the whole slot out.
    reduce-scatter  each rank copies its whole input into its row of a slot;
                    after the barrier, each sums its chunk of every row, adding
                    the ranks in the order Gloo's ring all-reduce does (see
                    [Note: Gloo's summation order] in ``gloo_order.py``).
    all-reduce      the same, but each rank sums every element itself: more
                    additions than a reduce-scatter and an all-gather, but one
                    barrier (measured 4 MiB at 4 ranks: 2.7 ms against Gloo's
                    7.2).

The bytes move once in and once out, in plain ``copy_``/``add`` kernels, with
no system call; measured 4 MiB all-gather at 4 ranks on 2 cores: 1.2 ms against
4.7 ms for one Gloo broadcast per rank. The sums are bitwise Gloo's at every
world size. Every rank maps all the rows, which counts in its resident memory,
so an operation with more than ``PIECE_ROWS_BYTES`` of rows goes in even
pieces, one after another (a reduce-scatter's piece: the same columns of every
chunk).

Three slots rotate. A rank issuing operation ``n`` first reads out its own
operations up to ``n - 2`` that its caller has not waited for yet, and waits
for (without reading) barrier ``n - 1``: every rank has then issued ``n - 1``,
so has read everything up to ``n - 3``, whose slot ``n`` reuses. Completion is
the caller's: an operation's result is written when its handle is waited on
(``HostOp.finish``, through the collectives' ``Pending.wait``), which first
finishes the group's earlier operations in order. Only a caller that leaves
more than two operations of a group unwaited has the oldest read out early, by
the issue of a later one (its output buffer is the caller's from the moment it
is issued, as with Gloo). fully_shard keeps at most two in flight (an
all-gather and its prefetch).

Each group gets its own :class:`HostArena` (keyed by the group object: ranks that
are threads of one process never share one). Ranks on different hosts, or a
host without ``/dev/shm``, get ``None`` and the Gloo compositions.

[Note: operating the shared-memory transport]
``TENSORPLAY_SHM=0`` (read when a group first communicates) or
:func:`set_shared_memory` ``(False)`` turns it off: every collective then takes
the Gloo compositions, whose results are bitwise the same. A group that does not
use it, or stops using it, says so once, through :mod:`logging` under
``tensorplay.distributed``: which group, why (switched off, ranks on several
hosts, ``/dev/shm`` missing or full, no pipe barrier) and what it uses instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import socket
import tempfile
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .gloo_order import ring_sum_orders
from .host_barrier import BarrierWork, PipeBarrier, open_pipe_barrier
from .host_files import SHM_DIR, name_prefix, path_from_rank0

__all__ = ["PIECE_ROWS_BYTES", "SMALL_BYTES", "HostArena", "HostOp", "all_reduce_now", "arena_for", "issue_all_reduce",
           "mapped_slots", "ruled_out", "set_shared_memory", "shared_memory_enabled"]

_ALIGN = 64  # bytes: every slot and row starts on a cache line
_SLOTS = 3
SMALL_BYTES = 64 * 1024  # below this an all-reduce is latency: one Gloo call is as fast
#: At most this many bytes in one operation's rows (world x what each rank stages); larger collectives go in even
#: pieces. Every rank maps and reads all the rows, which counts in its resident memory: the three slots take at
#: most three times this (fully_shard at 4 ranks, 4 MiB units: a reduce-scatter's rows were 16 MiB, 48 MiB of
#: slots per rank).
PIECE_ROWS_BYTES = 4 * 1024 * 1024

Barrier = dist.Work | BarrierWork
Wait = Callable[[Barrier], None]

_LOG = logging.getLogger("tensorplay.distributed")
_SWITCH: list[bool] = []  # set_shared_memory's choice, if any (else TENSORPLAY_SHM decides)


def set_shared_memory(enabled: bool | None) -> None:
    """Turn the shared-memory transport on or off for groups that communicate from now on (None: the env)."""
    _SWITCH[:] = [] if enabled is None else [bool(enabled)]


def shared_memory_enabled() -> bool:
    """Whether new groups may use shared memory: :func:`set_shared_memory`, else ``TENSORPLAY_SHM`` (default on)."""
    if _SWITCH:
        return _SWITCH[0]
    return os.environ.get("TENSORPLAY_SHM", "1").strip().lower() not in ("0", "false", "off", "no")


def describe_group(group: ProcessGroup) -> str:
    return f"process group {group.group_name!r} (global ranks {dist.get_process_group_ranks(group)})"


def _fall_back(group: ProcessGroup, why: str, level: int = logging.INFO) -> None:
    _LOG.log(level, "%s: %s; its collectives use Gloo's own calls and their compositions instead of shared memory",
             describe_group(group), why)


def _plain_wait(work: Barrier) -> None:
    work.wait()


def _host_id() -> int:
    """This host, as a positive number the ranks of a group can compare (0: it has no usable /dev/shm)."""
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return 0
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = hashlib.blake2b(f"{socket.gethostname()}/{boot}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little") + 1


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class HostOp:
    """One issued shared-memory collective: ``finish()`` waits its ``barrier`` and reads the result.

    Finishing it first finishes the arena's earlier operations, in order (their slots are read in the order
    they were issued).
    """

    barrier: Barrier
    read: Callable[[], object]
    wait_barrier: Wait = _plain_wait
    finished: bool = False
    arrived: bool = False  # its barrier completed: every rank staged it
    earlier: Callable[[HostOp], None] | None = None  # finishes the arena's operations issued before this one

    def finish(self) -> None:
        if self.earlier is not None:
            self.earlier(self)
        self.finish_alone()

    def finish_alone(self) -> None:
        if not self.finished:
            read = self._release()
            self.await_barrier()
            read()

    def drop(self) -> None:
        """Wait for the barrier but never write the result (its output is not wanted any more)."""
        if not self.finished:
            self._release()
            self.await_barrier()

    def await_barrier(self) -> None:
        if not self.arrived:
            self.wait_barrier(self.barrier)
            self.arrived = True

    def _release(self) -> Callable[[], object]:
        """Mark the operation finished and let go of ``read`` (and the input and output it holds).

        The arena keeps its unfinished operations until they are finished: holding ``read`` past the finish
        would keep the caller's buffers alive between steps.
        """
        read, self.read, self.finished = self.read, _read_nothing, True
        return read


def _read_nothing() -> None:
    return None


@dataclass
class _Fill:
    """What a rank stages for a piece, written straight into its slot row by ``write(row)`` (no tensor of it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    write: Callable[[torch.Tensor], None]


class HostArena:
    """The shared slots of one process group whose ranks all run on this host."""

    def __init__(self, group: ProcessGroup, pipes: PipeBarrier | None = None) -> None:
        self._group_ref = weakref.ref(group)
        self._pipes = pipes  # the barrier; None: a one-element Gloo all-reduce
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._slots: torch.Tensor | None = None  # uint8, _SLOTS x slot_bytes, shared with every rank
        self._slot_bytes = 0
        self._issued = 0
        self._unfinished: deque[HostOp] = deque()  # issued, in order; the caller has not waited for them
        self._flag = torch.zeros(1)
        self._lock = threading.Lock()
        self._full = False  # /dev/shm had no room once: every later operation takes another algorithm

    @property
    def group(self) -> ProcessGroup:
        group = self._group_ref()
        if group is None:
            raise RuntimeError("shared-memory collective: its process group was destroyed")
        return group

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, wait: Wait = _plain_wait) -> HostOp | None:
        """Gather every rank's 1D ``shard`` into ``output`` (1D, ``world * shard.numel()``), in rank order.

        None (on every rank) when /dev/shm has no room for it: use another algorithm.
        """
        gathered = output.view(self.world, -1)

        def write(begin: int, end: int, rows: torch.Tensor) -> None:
            gathered[:, begin:end].copy_(rows)

        return self.all_gather_into(write, shard, wait)

    def all_gather_into(self, write: Callable[[int, int, torch.Tensor], None], shard: torch.Tensor,
                        wait: Wait = _plain_wait) -> HostOp | None:
        """Gather every rank's 1D ``shard``; ``write(begin, end, rows)`` takes columns ``[begin, end)`` of every
        rank's shard, ``rows`` being ``(world, end - begin)``, straight from the shared slot (no output buffer).

        None (on every rank) when /dev/shm has no room for it: use another algorithm.
        """
        with self._lock:
            return self._in_pieces(shard.numel(), self.world * shard.element_size(), lambda b, e: shard[b:e], write,
                                   wait)

    def reduce_scatter(self, shard_out: torch.Tensor, full: torch.Tensor, wait: Wait = _plain_wait) -> HostOp | None:
        """Sum ``full`` (1D, ``world * shard_out.numel()``) across ranks as Gloo would; keep this rank's chunk.

        A piece stages the same columns of every chunk, so ``shard_out`` may be this rank's chunk of ``full``.
        None (on every rank) when /dev/shm has no room for it: use another algorithm.
        """
        chunks = full.view(self.world, shard_out.numel())

        def fill(begin: int, end: int, row: torch.Tensor) -> None:
            row.copy_(chunks[:, begin:end])

        return self.reduce_scatter_from(fill, shard_out, full.dtype, wait)

    def reduce_scatter_from(self, fill: Callable[[int, int, torch.Tensor], None], shard_out: torch.Tensor,
                            dtype: torch.dtype, wait: Wait = _plain_wait) -> HostOp | None:
        """:meth:`reduce_scatter` of an input that exists only as ``fill(begin, end, row)``: write columns
        ``[begin, end)`` of every rank's chunk into ``row`` (``(world, end - begin)``, in this rank's slot row).

        Everything is staged before this returns: the input is not needed afterwards.
        """
        size, shard = dtype.itemsize, shard_out.numel()
        total, first = self.world * shard, self.rank * shard

        def read(begin: int, end: int, rows: torch.Tensor) -> None:  # holds no reference to the input
            own = rows.view(self.world, self.world, end - begin)[:, self.rank]
            runs = ring_sum_orders(total, size, self.world, first + begin, first + end)
            _add_rows(shard_out[begin:end], own, runs, first + begin)

        def mine(begin: int, end: int) -> _Fill:
            return _Fill((self.world, end - begin), dtype, lambda row: fill(begin, end, row))

        with self._lock:
            return self._in_pieces(shard, self.world * self.world * size, mine, read, wait)

    def all_reduce(self, tensor: torch.Tensor, wait: Wait = _plain_wait) -> HostOp | None:
        """Sum the contiguous ``tensor`` in place across ranks as Gloo would.

        Every rank adds all the rows itself: one barrier, and no second round that a rank waiting elsewhere
        could hold up. None (on every rank) when /dev/shm has no room for it: use another algorithm.
        """
        flat = tensor.view(-1)
        numel, size = flat.numel(), flat.element_size()

        def read(begin: int, end: int, rows: torch.Tensor) -> None:
            _add_rows(flat[begin:end], rows, ring_sum_orders(numel, size, self.world, begin, end), begin)

        with self._lock:
            return self._in_pieces(numel, self.world * size, lambda b, e: flat[b:e], read, wait)

    def broadcast(self, tensor: torch.Tensor, src: int, wait: Wait = _plain_wait) -> HostOp | None:
        """Copy group rank ``src``'s contiguous ``tensor`` into every rank's (one row: only ``src`` writes).

        None (on every rank) when /dev/shm has no room for it: use another algorithm.
        """
        flat = tensor.view(-1)

        def read(begin: int, end: int, rows: torch.Tensor) -> None:
            if self.rank != src:
                flat[begin:end].copy_(rows[0])

        with self._lock:
            return self._in_pieces(flat.numel(), flat.element_size(), lambda b, e: flat[b:e], read, wait, writer=src)

    def _in_pieces(self, count: int, row_bytes: int, mine: Callable[[int, int], torch.Tensor | _Fill],
                   read: Callable[[int, int, torch.Tensor], None], wait: Wait,
                   writer: int | None = None) -> HostOp | None:
        """One collective over ``count`` units (``row_bytes`` of rows each), in even pieces of the slots' size.

        ``mine(begin, end)`` is what this rank stages for units ``[begin, end)``; ``read(begin, end, rows)``
        takes the result out of every rank's rows. Issuing a piece finishes the one before (every rank has
        issued it), so only the last stays in flight; the others' results are written already. ``writer``:
        only that rank stages, into the one row there is.
        """
        op = None
        for begin, end in _piece_bounds(count, row_bytes):
            rows = self._stage(mine(begin, end), wait, writer)
            if rows is None:  # only the first piece can grow the slots
                return None
            op = self._post(functools.partial(read, begin, end, rows), wait)
        return op

    def _stage(self, mine: torch.Tensor | _Fill, wait: Wait, writer: int | None = None) -> torch.Tensor | None:
        """The next operation's slot as one row of ``mine``'s elements per rank, ``mine`` copied into this rank's.

        ``writer``: one row only, which that rank fills. None (nothing copied) when there is no room.
        """
        shape, dtype = tuple(mine.shape), mine.dtype
        nbytes = math.prod(shape) * dtype.itemsize
        row, count = _aligned(nbytes), self.world if writer is None else 1
        slot = self._next_slot(row * count, wait)
        if slot is None:
            return None
        rows = slot[: row * count].view(count, row)[:, :nbytes].view(dtype)
        if writer is None or writer == self.rank:
            target = rows[self.rank if writer is None else 0].view(shape)
            if isinstance(mine, _Fill):
                mine.write(target)
            else:
                target.copy_(mine)
        return rows

    def _next_slot(self, nbytes: int, wait: Wait) -> torch.Tensor | None:
        """The slot for the next operation, once every rank has read the one it held before (None: no room)."""
        unfinished = self._unfinished
        while len(unfinished) > 1:  # two or more back: read out now (see the module's note)
            unfinished.popleft().finish_alone()
        if unfinished:
            unfinished[0].await_barrier()  # every rank issued it: each has read what the slot held
        if self._full:
            return None
        if nbytes > self._slot_bytes and not self._map(nbytes, wait):
            self._full = True
            _fall_back(self.group, f"{_SLOTS} slots of {_aligned(nbytes)} bytes could not be mapped from {SHM_DIR} "
                                   "on every rank (full, or another /dev/shm behind the same host name)",
                       logging.WARNING)
            return None
        assert self._slots is not None
        return self._slots[self._issued % _SLOTS]

    def _post(self, read: Callable[[], object], wait: Wait) -> HostOp:
        op = HostOp(self._barrier(), read, wait, earlier=self._finish_before)
        self._issued += 1
        self._unfinished.append(op)
        return op

    def _finish_before(self, op: HostOp) -> None:
        """Finish, in order, the operations issued before ``op`` (and ``op`` itself leaves the queue)."""
        if op.finished:  # read out already (or dropped): nothing before it is left unread
            return
        while self._unfinished:
            first = self._unfinished.popleft()
            if first is op:
                return
            first.finish_alone()

    def _barrier(self) -> Barrier:
        if self._pipes is not None:
            return self._pipes.arrive()
        work = dist.all_reduce(self._flag, group=self.group, async_op=True)
        assert work is not None
        return work

    def _map(self, slot_bytes: int, wait: Wait) -> bool:
        """Map fresh slots of ``slot_bytes`` on every rank; False on every rank when that cannot be done.

        A collective: every rank grows at the same operation. Rank 0 reserves the memory up front, so a full
        /dev/shm (a container's default 64 MiB) is a fallback here, not a SIGBUS later; a rank that cannot map
        rank 0's file (another /dev/shm behind the same host name) makes every rank fall back too.

        The file has a name only while every rank is here: rank 0 makes it once all have arrived, and it is
        unlinked as soon as all have mapped it (the mappings stay valid). A job killed while a rank is late
        (rank 0 waiting for it) leaves nothing in /dev/shm.
        """
        slot_bytes = _aligned(slot_bytes)
        wait(dist.all_reduce(torch.zeros(1), group=self.group, async_op=True))  # every rank is here
        path = path_from_rank0(lambda: _reserve(_SLOTS * slot_bytes), self.group, wait, _unlink)
        if not path:
            return False
        try:
            slots = _map_shared(path, _SLOTS * slot_bytes)
            mapped = torch.tensor([int(slots is not None)])
            # also the barrier after which the name can go: every rank has tried to map it
            wait(dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        finally:
            _unlink(path)  # every rank, also when a peer died: any survivor does it
        if slots is None or not mapped.item():
            return False
        self._slots, self._slot_bytes = slots.view(_SLOTS, slot_bytes), slot_bytes
        return True


def _map_shared(path: str, nbytes: int) -> torch.Tensor | None:
    """``path`` mapped shared, if it is the file rank 0 made (it starts with its own name); else None.

    Never creates it: a rank behind another /dev/shm with the same host name would leave its own file behind.
    """
    if not os.path.isfile(path):
        return None
    try:
        mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    stamp = path.encode()
    return mapped if bytes(mapped[: len(stamp)].tolist()) == stamp else None


def _piece_bounds(count: int, row_bytes: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of even pieces of ``count`` units, each with at most ``PIECE_ROWS_BYTES`` of rows."""
    pieces = max(1, -(-count * row_bytes // PIECE_ROWS_BYTES))
    step = max(1, -(-count // pieces))
    return [(begin, min(count, begin + step)) for begin in range(0, count, step)] or [(0, 0)]


def _add_rows(out: torch.Tensor, rows: torch.Tensor, runs: list[tuple[int, int, list[int]]], first: int) -> None:
    """``out`` = the sum of ``rows`` (one per rank), each run of elements added in its ranks' order.

    ``runs`` index the whole buffer; ``out`` and ``rows`` hold its elements from ``first`` on.
    """
    for begin, end, ranks in runs:
        here, parts = out[begin - first: end - first], rows[:, begin - first: end - first]
        if len(ranks) == 1:
            here.copy_(parts[ranks[0]])
            continue
        torch.add(parts[ranks[0]], parts[ranks[1]], out=here)
        for r in ranks[2:]:
            here.add_(parts[r])


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _reserve(nbytes: int) -> str:
    """A new file of ``nbytes`` in /dev/shm with its memory allocated, stamped with its name ("": no room)."""
    fd, path = tempfile.mkstemp(prefix=name_prefix(), dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        os.pwrite(fd, path.encode(), 0)  # the stamp other ranks check (see _map_shared)
    except OSError:
        os.unlink(path)
        return ""
    finally:
        os.close(fd)
    return path


_ARENAS: weakref.WeakKeyDictionary[ProcessGroup, HostArena | None] = weakref.WeakKeyDictionary()


def forget(group: ProcessGroup) -> None:
    """Drop the arena of ``group`` (its pipe barrier closes its FIFOs when collected). Safe for a group never seen."""
    _ARENAS.pop(group, None)


def ruled_out(group: ProcessGroup) -> bool:
    """Whether ``group`` is known to have no usable arena (ranks on several hosts, or /dev/shm was full)."""
    if group not in _ARENAS:
        return not shared_memory_enabled()
    arena = _ARENAS[group]
    return arena is None or arena._full


def issue_all_reduce(group: ProcessGroup, tensor: torch.Tensor, wait: Wait = _plain_wait) -> HostOp | None:
    """Issue the sum of the contiguous CPU ``tensor`` across ``group`` through the group's arena (found on the
    first call, a collective). None (on every rank) when the group has none (ranks on several hosts, switched
    off) or /dev/shm has no room for it: use another algorithm."""
    if ruled_out(group):
        return None
    arena = arena_for(group, wait)
    return arena.all_reduce(tensor, wait) if arena is not None else None


def all_reduce_now(group: ProcessGroup, tensor: torch.Tensor, wait: Wait = _plain_wait) -> bool:
    """:func:`issue_all_reduce` and finish it: ``tensor`` holds the sum on return (True), or is untouched
    (False: use another algorithm). A blocking all-reduce's one call into this module."""
    op = issue_all_reduce(group, tensor, wait)
    if op is None:
        return False
    op.finish()
    return True


def mapped_slots() -> list[tuple[int, int]]:
    """``(bytes, ranks)`` of every slot file this process maps: each is mapped by that many ranks of the host.

    A rank's resident set counts every page of them it touched, although the host holds each page once.
    """
    return [(arena._slots.nbytes, arena.world) for arena in list(_ARENAS.values())
            if arena is not None and arena._slots is not None]


def arena_for(group: ProcessGroup, wait: Wait = _plain_wait) -> HostArena | None:
    """The shared-memory arena of ``group``, or None when its ranks are not all on this host.

    The first call is a collective (the ranks compare hosts): every rank must make it at the same point.
    """
    if group in _ARENAS:
        return _ARENAS[group]
    if not shared_memory_enabled():
        _fall_back(group, "shared memory is switched off (TENSORPLAY_SHM=0 or set_shared_memory(False))")
        _ARENAS[group] = None
        return None
    host = _host_id()
    seen = torch.tensor([host, -host], dtype=torch.int64)  # after a MAX: the largest and minus the smallest
    wait(dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group, async_op=True))
    if seen[0].item() != -seen[1].item() or host == 0:
        _fall_back(group, f"no {SHM_DIR} on this host" if host == 0 else
                   f"{SHM_DIR} is missing on a rank, or the ranks run on several hosts",
                   logging.WARNING if host == 0 else logging.INFO)
        _ARENAS[group] = None
        return None
    pipes = open_pipe_barrier(group, wait)
    if pipes is None:
        _LOG.info("%s: no named pipes could be made in %s for the shared-memory barrier; it uses a one-element "
                  "Gloo all-reduce as the barrier instead", describe_group(group), SHM_DIR)
    arena = _ARENAS[group] = HostArena(group, pipes)
    return arena
