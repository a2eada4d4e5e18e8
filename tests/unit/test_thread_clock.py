"""The idle signal of the collective watch (``_comm/thread_clock.py``): a thread's CPU time, read from /proc."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tensorplay.distributed._comm.thread_clock import IdleClock, thread_state

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def test_a_blocked_thread_is_idle_since_the_first_sample() -> None:
    release = threading.Event()
    blocked = threading.Thread(target=release.wait)
    blocked.start()
    try:
        clock = IdleClock()
        assert clock.sample(blocked.native_id) == 0.0  # the first sample: idle since now
        time.sleep(0.05)
        idle_s = clock.sample(blocked.native_id)
        assert idle_s is not None and idle_s > 0.0
    finally:
        release.set()
        blocked.join()


def test_a_thread_whose_cpu_time_moved_is_not_idle() -> None:
    me = threading.get_native_id()
    clock = IdleClock()
    clock.sample(me)
    time.sleep(0.01)  # the sample's clock moves on
    start = _cpu_s(me)
    while _cpu_s(me) == start:  # compute until the CPU time moves (one clock tick)
        sum(range(10_000))
    assert clock.sample(me) == 0.0


def test_an_unknown_thread_or_one_not_in_this_process_gives_no_signal() -> None:
    not_ours = 4_194_305  # past the kernel's largest pid (PID_MAX_LIMIT)
    clock = IdleClock()
    assert clock.sample(None) is None and clock.sample(0) is None
    assert thread_state(not_ours) is None and clock.sample(not_ours) is None


def test_a_thread_in_uninterruptible_io_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``fsync`` or a read from slow storage (state D) uses no CPU but is not idle: never named blocked."""
    from tensorplay.distributed._comm import thread_clock

    states = iter([("S", 1.0), ("D", 1.0), ("S", 1.0)])
    monkeypatch.setattr(thread_clock, "thread_state", lambda native_id: next(states))
    clock = IdleClock()
    clock.sample(123)
    time.sleep(0.01)
    assert clock.sample(123) == 0.0  # in I/O: idle from now on at most
    time.sleep(0.01)
    idle_s = clock.sample(123)
    assert idle_s is not None and idle_s > 0.0  # out of it, its CPU time unchanged: idle since the I/O


def _cpu_s(native_id: int) -> float:
    state = thread_state(native_id)
    assert state is not None, f"/proc/self/task/{native_id}/stat could not be read"
    return state[1]
