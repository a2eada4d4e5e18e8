"""At interpreter exit, let the backend's worker threads finish with Python objects first.

[Note: hook futures at exit]
A DDP communication hook's future is completed on a worker thread of the
backend (Gloo's ``pt_gloo_runloop``). After completing it, that thread still
releases what the chain held: the hooks' Python callbacks (``fut.then(fn)``),
``collect_all``'s futures and the Python-owned tensors in their values, and
each release takes the GIL. DDP returns as soon as the future completes, so a
script that ends right after its last ``backward()`` can reach interpreter
finalization while that thread waits for the GIL. CPython 3.11 then ends the
thread with ``pthread_exit``, whose unwinding crosses a ``noexcept`` C++
destructor: "terminate called without an active exception" and SIGABRT,
after correct results (PyTorch issue 38228; PyTorch's own hooks do the same).

So the first hook call registers an exit handler that releases the GIL until
the backend's worker threads are idle: each is asleep and used no CPU time
over two consecutive short sleeps of the main thread (a worker waiting for the
GIL gets it during such a sleep and runs). It waits at most ``_LIMIT_S``, for
work that completes, not for a collective still in flight; where
``/proc/self/task`` does not exist it sleeps ``_FALLBACK_S`` once.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

__all__ = ["settle_at_exit"]

_WORKER_NAMES = frozenset({"pt_gloo_runloop"})
_TICK_S = 0.002
_QUIET_TICKS = 2
_LIMIT_S = 2.0
_FALLBACK_S = 0.05
_TASKS = "/proc/self/task"

_registered = False
_lock = threading.Lock()


def settle_at_exit() -> None:
    """Register (once per process) the exit handler of [Note: hook futures at exit]."""
    global _registered
    if _registered:
        return
    with _lock:
        if not _registered:
            atexit.register(_settle)
            _registered = True


def _workers() -> dict[str, tuple[str, int]] | None:
    """``{thread id: (state, CPU ns)}`` of the backend's worker threads; None without ``/proc``."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    found = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as comm:
                if comm.read().strip() not in _WORKER_NAMES:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
            with open(f"{_TASKS}/{tid}/schedstat") as schedstat:
                ran = int(schedstat.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended, or the kernel keeps no schedstat: judged on the others
        found[tid] = (state, ran)
    return found


def _settle(limit_s: float = _LIMIT_S) -> None:
    """Sleep (GIL released) until every worker thread slept and used no CPU over ``_QUIET_TICKS`` ticks."""
    before = _workers()
    if before is None:
        time.sleep(_FALLBACK_S)
        return
    deadline = time.monotonic() + limit_s
    quiet = 0
    while before and quiet < _QUIET_TICKS and time.monotonic() < deadline:
        time.sleep(_TICK_S)
        after = _workers() or {}
        idle = after.keys() == before.keys() and all(
            state == "S" and ran == before[tid][1] for tid, (state, ran) in after.items())
        quiet = quiet + 1 if idle else 0
        before = after
