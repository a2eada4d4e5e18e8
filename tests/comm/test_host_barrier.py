"""The pipe barrier of the shared-memory collectives (``_comm/host_barrier.py``), on real FIFOs in one process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from tensorplay.distributed._comm.host_barrier import PipeBarrier


@pytest.fixture
def fifos(tmp_path) -> Iterator[dict[int, tuple[int, int]]]:
    """Three FIFOs, one per rank: rank -> (read fd, write fd)."""
    ends = {}
    for rank in range(3):
        path = tmp_path / str(rank)
        os.mkfifo(path)
        read = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        ends[rank] = (read, os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    yield ends
    for read, write in ends.values():
        for fd in (read, write):
            try:
                os.close(fd)
            except OSError:
                pass


def _barrier(fifos, rank: int, pids: dict[int, int] | None = None) -> PipeBarrier:
    peers = {peer: os.dup(write) for peer, (_, write) in fifos.items() if peer != rank}
    return PipeBarrier(rank, len(fifos), os.dup(fifos[rank][0]), peers, pids or {})


def test_three_ranks_pass_each_barrier_only_once_all_arrived(fifos):
    ranks = [_barrier(fifos, rank) for rank in range(3)]
    first = [ranks[0].arrive(), ranks[1].arrive()]
    assert not first[0].is_completed() and not first[1].is_completed()
    third = ranks[2].arrive()
    assert all(work.wait(timeout=timedelta(seconds=5)) for work in [*first, third])


def test_a_peer_one_barrier_ahead_is_counted_per_sender(fifos):
    """Rank 1 arrives twice before rank 2 arrives once: rank 0's first barrier still waits for rank 2."""
    ranks = [_barrier(fifos, rank) for rank in range(3)]
    zero = ranks[0].arrive()
    ranks[1].arrive()
    ranks[1].arrive()
    assert not zero.is_completed()
    ranks[2].arrive()
    assert zero.is_completed()
    assert not ranks[0].arrive().is_completed()  # barrier 2 lacks rank 2's second arrival


def test_a_live_peer_that_never_arrives_times_out(fifos):
    barrier = _barrier(fifos, 0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"shared-memory barrier timed out after 0\.3 s \(rank 0 waiting"):
        barrier.arrive().wait(timeout=timedelta(seconds=0.3))
    assert time.monotonic() - start >= 0.25


def test_a_peer_whose_process_exited_is_named(fifos):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    barrier = _barrier(fifos, 0, pids={1: os.getpid(), 2: dead.pid})
    work = barrier.arrive()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 2 of the group \(pid {dead.pid}\) has exited"):
        work.wait(timeout=timedelta(seconds=30))
    assert time.monotonic() - start < 5


def test_writing_to_a_peer_without_reader_names_it(tmp_path):
    path = tmp_path / "peer"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    own = tmp_path / "own"
    os.mkfifo(own)
    barrier = PipeBarrier(0, 2, os.open(own, os.O_RDWR | os.O_NONBLOCK), {1: writer}, {})
    os.close(reader)  # the peer's process is gone: no reader is left
    work = barrier.arrive()  # the arrival goes on; its wait fails, where the collective watch diagnoses it
    assert not work.is_completed()
    with pytest.raises(RuntimeError, match=r"rank 1 of the group has exited \(its pipe has no reader\)"):
        work.wait()


def test_a_killed_peer_its_parent_has_not_reaped_counts_as_dead(fifos):
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie.kill()  # not waited for: a zombie until reaped
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    try:
        barrier = _barrier(fifos, 0, pids={1: os.getpid(), 2: zombie.pid})
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 2 of the group \(pid {zombie.pid}\) has exited"):
            barrier.arrive().wait(timeout=timedelta(seconds=30))
        assert time.monotonic() - start < 5
    finally:
        zombie.wait()


def test_a_peer_whose_pipe_lost_its_reader_is_seen_while_waiting_in_any_pid_namespace(tmp_path):
    """No pid to check (another pid namespace): the peer's pipe reporting no reader is enough, at once."""
    os.mkfifo(tmp_path / "peer")
    reader = os.open(tmp_path / "peer", os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(tmp_path / "peer", os.O_WRONLY | os.O_NONBLOCK)
    os.mkfifo(tmp_path / "own")
    barrier = PipeBarrier(0, 2, os.open(tmp_path / "own", os.O_RDWR | os.O_NONBLOCK), {1: writer}, {})
    work = barrier.arrive()
    os.close(reader)  # the peer's process is gone, after this rank arrived
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 of the group has exited \(its pipe has no reader\)"):
        work.wait(timeout=timedelta(seconds=30))
    assert time.monotonic() - start < 0.5


def test_a_process_forked_from_a_rank_does_not_keep_its_pipes_open(fifos):
    barrier = _barrier(fifos, 0)
    fds = list(barrier._fds)
    child = os.fork()
    if child == 0:  # a DataLoader worker, say
        still_open = 0
        for fd in fds:
            try:
                os.fstat(fd)
                still_open += 1
            except OSError:
                pass
        os._exit(still_open)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child kept the rank's pipes open"
    assert all(os.fstat(fd) for fd in fds)  # the rank's own are untouched


def test_a_rank_never_creates_the_slot_file_it_is_told_to_map(tmp_path):
    """Behind another /dev/shm with the same host name, rank 0's file is missing here: nothing is left behind."""
    from tensorplay.distributed._comm.host_memory import _map_shared

    missing = tmp_path / "tensorplay-missing"
    assert _map_shared(str(missing), 4096) is None
    assert not missing.exists()


def _exit(fifos, barrier: PipeBarrier, rank: int) -> None:
    """Rank ``rank``'s process is gone: every reader of its FIFO closed."""
    barrier.close_in_child()
    os.close(fifos[rank][0])


def test_a_peer_that_arrived_then_exited_completed_the_barrier(fifos):
    """The exit race: rank 1 arrives at the last barrier and exits before rank 0 arrives (rank 0's write to it
    fails), and before rank 0 read its byte. Every rank arrived: the barrier completes; the next one fails."""
    two = {rank: fifos[rank] for rank in (0, 1)}
    zero, one = _barrier(two, 0), _barrier(two, 1)
    one.arrive()
    _exit(two, one, 1)
    assert zero.arrive().wait(timeout=timedelta(seconds=5))
    with pytest.raises(RuntimeError, match=r"rank 1 of the group has exited \(its pipe has no reader\) before "
                                           r"arriving at barrier 2"):
        zero.arrive().wait(timeout=timedelta(seconds=5))


def test_a_peer_that_arrives_and_exits_while_this_rank_waits_completed_the_barrier(fifos):
    """Rank 1's byte and its hang-up reach rank 0 in one poll: the byte is counted before the hang-up."""
    two = {rank: fifos[rank] for rank in (0, 1)}
    zero, one = _barrier(two, 0), _barrier(two, 1)
    work = zero.arrive()
    real = zero._poller

    class PeerActsDuringPoll:
        def __init__(self) -> None:
            self.acted = False

        def poll(self, timeout_ms: float) -> list:
            if not self.acted:
                self.acted = True
                one.arrive()
                _exit(two, one, 1)
            events = real.poll(timeout_ms)
            return events

        def unregister(self, fd: int) -> None:
            real.unregister(fd)

    zero._poller = PeerActsDuringPoll()  # type: ignore[assignment]
    assert work.wait(timeout=timedelta(seconds=5))
    assert zero._poller.acted
