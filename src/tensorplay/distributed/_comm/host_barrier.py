"""A barrier among the ranks of one host, through named pipes.

[Note: the pipe barrier]
Every shared-memory collective (``host_memory.py``) needs one barrier: "every
rank has written its row". A one-element Gloo all-reduce does it in a ring of
TCP round trips on Gloo's worker threads: measured 1.24 ms at 4 ranks on 2
cores, 0.4 ms at 2. Here each rank owns a FIFO in ``/dev/shm``; arriving at a
barrier writes one byte, the sender's rank, into every peer's FIFO; waiting
reads its own FIFO until every peer has arrived: 0.06 ms at 2 and at 4 ranks.

- A peer can be one barrier ahead: a rank that completed barrier ``n`` may
  arrive at ``n + 1`` before a slower rank has read all of ``n``'s bytes. So the
  bytes are counted per sender, and barrier ``n`` is reached when every peer's
  count is ``n``.
- Writing and reading a pipe are system calls that take the pipe's lock. So a
  rank that read a peer's byte sees everything that peer wrote into the
  shared slot before it arrived.
- A dead peer is never silent. Its pipe has no reader left: writing to it
  fails, and a waiting rank, which also polls its peers' pipes, sees the
  error at once, whatever the pid namespace (containers). A wait that makes no
  progress for a second also checks whether each missing peer's process is
  alive, when it runs in this pid namespace; a killed process its parent has
  not reaped yet (a zombie) counts as dead. A process forked from a rank (a
  DataLoader worker) closes the rank's pipes at once, so it never keeps a dead
  rank's pipe open. A live but stuck peer gives a "timed out" at
  the caller's timeout (the collective watch's slices, see ``watch.py``), or
  at the group's own ``timeout=`` when none was given, as Gloo would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.constants import default_pg_timeout

from .host_files import SHM_DIR, name_prefix, path_from_rank0
from .watch import group_timeout_s

__all__ = ["BarrierWork", "PipeBarrier", "open_pipe_barrier"]

_LIVENESS_S = 1.0  # a wait that makes no progress this long checks whether the missing peers are alive
MAX_RANKS = 256  # one byte names the sender

Wait = Callable[[dist.Work], None]


class PipeBarrier:
    """The FIFOs of one group's ranks on this host: ``arrive()`` at each barrier, wait on what it returns."""

    def __init__(self, rank: int, world: int, own: int, peers: dict[int, int], pids: dict[int, int],
                 timeout_s: float = default_pg_timeout.total_seconds()) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._own, self._peers, self._pids = own, peers, pids  # fds: own FIFO (read), peers' FIFOs (write)
        self._token = bytes([rank])
        self._arrived = [0] * world  # barriers each peer has arrived at, as far as this rank has read
        self._issued = 0
        self._gone: dict[int, str] = {}  # peers found gone -> how (see [Note: a peer that arrived, then left])
        self._lock = threading.Lock()
        self._poller = select.poll()
        self._poller.register(own, select.POLLIN)
        for fd in peers.values():
            self._poller.register(fd, 0)  # POLLERR only: the peer's pipe lost its reader (the peer is gone)
        self._fds = [own, *peers.values()]
        weakref.finalize(self, _close, self._fds)
        _OPEN.add(self)

    def arrive(self) -> BarrierWork:
        """Tell every peer this rank arrived at its next barrier; the returned work completes when all have.

        A peer that has exited fails the work's ``wait()``, not the arrival, and only if it left before
        arriving at that barrier (see [Note: a peer that arrived, then left]).
        """
        self._issued += 1
        for peer, fd in self._peers.items():
            if peer in self._gone:
                continue
            try:
                os.write(fd, self._token)
            except BrokenPipeError:
                self._left(peer, "has exited (its pipe has no reader)")
        return BarrierWork(self, self._issued)

    def reached(self, barrier: int, timeout_s: float = 0.0) -> bool:
        """Whether every peer arrived at ``barrier``, reading the pipe for up to ``timeout_s`` seconds.

        [Note: a peer that arrived, then left]
        A rank may arrive at the last barrier and exit before this one has read its
        byte: its pipe then has no reader, but its byte is already in ours (it wrote
        before it exited, and the pipe keeps what was written). So a peer found gone
        (its pipe hung up, a write to it failed, its process is dead) is only a
        failure after every byte waiting in this rank's pipe has been counted, and
        only if it had not arrived at this barrier.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                while self._read_arrivals():
                    pass
                missing = [peer for peer in self._peers if self._arrived[peer] < barrier]
                if not missing:
                    return True
                gone = [peer for peer in missing if peer in self._gone]
                if gone:
                    raise RuntimeError(f"shared-memory barrier: rank {gone[0]} of the group {self._gone[gone[0]]} "
                                       f"before arriving at barrier {barrier}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                events = self._poller.poll(min(left, _LIVENESS_S) * 1000.0)
                if not events:
                    self._check_alive(missing)
                self._check_readers(fd for fd, event in events if event & (select.POLLERR | select.POLLHUP))

    def _read_arrivals(self) -> bool:
        """Count the bytes waiting in this rank's pipe (False: there were none)."""
        try:
            tokens = os.read(self._own, 4096)
        except BlockingIOError:
            return False
        for sender in tokens:
            self._arrived[sender] += 1
        return bool(tokens)

    def _left(self, peer: int, how: str) -> None:
        """Record that ``peer`` is gone (judged by :meth:`reached`); its pipe is no longer polled."""
        if peer not in self._gone:
            self._gone[peer] = how
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(self._peers[peer])

    def _check_readers(self, failed: Iterable[int]) -> None:
        for fd in failed:
            peer = next((peer for peer, peer_fd in self._peers.items() if peer_fd == fd), None)
            if peer is not None:
                self._left(peer, "has exited (its pipe has no reader)")

    def close_in_child(self) -> None:
        """In a process forked from this rank: close the pipes (the child must not keep them open)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def _check_alive(self, peers: list[int]) -> None:
        for peer in peers:
            pid = self._pids.get(peer)
            if pid is not None and not pid_alive(pid):
                self._left(peer, f"(pid {pid}) has exited")


class BarrierWork:
    """One barrier of a :class:`PipeBarrier`, waited like a ``dist.Work``."""

    def __init__(self, barrier: PipeBarrier, number: int) -> None:
        self._barrier, self._number = barrier, number

    def is_completed(self) -> bool:
        try:
            return self._barrier.reached(self._number)
        except RuntimeError:  # a peer left before arriving: not completed, and wait() says why
            return False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until every peer arrived; ``timeout`` defaults to the group's own ``timeout=``."""
        limit = timeout.total_seconds() if timeout is not None else self._barrier.timeout_s
        if not self._barrier.reached(self._number, limit):
            raise RuntimeError(f"shared-memory barrier timed out after {limit:.1f} s "
                               f"(rank {self._barrier.rank} waiting at barrier {self._number})")
        return True


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (in this pid namespace) is running: not gone, and not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


#: Every open barrier of this process: a forked child closes their pipes (see [Note: the pipe barrier]).
_OPEN: weakref.WeakSet[PipeBarrier] = weakref.WeakSet()


def _close_in_child() -> None:
    for barrier in list(_OPEN):
        barrier.close_in_child()


os.register_at_fork(after_in_child=_close_in_child)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def open_pipe_barrier(group: ProcessGroup, wait: Wait) -> PipeBarrier | None:
    """The pipe barrier of ``group``, whose ranks all run on this host; None on every rank if it can't be made.

    A collective. Rank 0 makes a directory and sends its name; each rank makes and opens its own FIFO there;
    once all have (a SUM all-reduce that also gathers pids), each opens its peers'; once all have (or a peer
    died on the way), every rank removes what is left of the directory, so nothing is left behind.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > MAX_RANKS:
        return None
    directory = path_from_rank0(_make_directory, group, wait, lambda made: _remove(made, world))
    own, peers = None, None
    try:
        own = _make_own_fifo(directory, rank) if directory else None
        # [failures, pid namespace of rank 0 .. world-1, pid of rank 0 .. world-1], summed
        shared = torch.zeros(1 + 2 * world, dtype=torch.int64)
        shared[0], shared[1 + rank], shared[1 + world + rank] = int(own is None), _pid_namespace(), os.getpid()
        wait(dist.all_reduce(shared, group=group, async_op=True))
        peers = _open_peers(directory, rank, world) if not shared[0].item() else None
        opened = torch.tensor([int(peers is not None)])
        wait(dist.all_reduce(opened, op=dist.ReduceOp.MIN, group=group, async_op=True))
    except BaseException:
        _close(([own] if own is not None else []) + list((peers or {}).values()))
        raise
    finally:  # every rank, also when a peer died during set-up: whichever survives removes the files
        if directory:
            _remove(directory, world)
    if peers is None or not opened.item():
        _close(([own] if own is not None else []) + list((peers or {}).values()))
        return None
    assert own is not None
    namespaces, pids = shared[1: 1 + world].tolist(), shared[1 + world:].tolist()
    ours = namespaces[rank]
    known = {peer: pids[peer] for peer in peers if ours and namespaces[peer] == ours}
    return PipeBarrier(rank, world, own, peers, known, group_timeout_s(group))


def _make_directory() -> str:
    try:
        return tempfile.mkdtemp(prefix=name_prefix("barrier-"), dir=SHM_DIR)
    except OSError:
        return ""


def _make_own_fifo(directory: str, rank: int) -> int | None:
    """This rank's FIFO, open for reading without blocking (also for writing: it never reads end-of-file)."""
    path = os.path.join(directory, str(rank))
    try:
        os.mkfifo(path, 0o600)
        return os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return None


def _open_peers(directory: str, rank: int, world: int) -> dict[int, int] | None:
    """Every peer's FIFO, open for writing (each has a reader: its owner opened it before the last all-reduce)."""
    peers: dict[int, int] = {}
    for peer in range(world):
        if peer == rank:
            continue
        try:
            peers[peer] = os.open(os.path.join(directory, str(peer)), os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno not in (errno.ENOENT, errno.ENXIO, errno.EACCES):
                raise
            for fd in peers.values():
                os.close(fd)
            return None
    return peers


def _remove(directory: str, world: int) -> None:
    """Remove the FIFOs and their directory; any rank may, any number of times (what is gone is skipped)."""
    for peer in range(world):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, str(peer)))
    with contextlib.suppress(FileNotFoundError, OSError):
        os.rmdir(directory)
