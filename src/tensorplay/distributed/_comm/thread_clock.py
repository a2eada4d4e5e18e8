"""How long a rank's thread has used no CPU: tells a rank that is computing from one blocked outside our collectives.

[Note: idle outside our collectives]
A rank that waits in a collective we do not issue (DDP's own all-reduce, a
user's collective) has no record of the collective its peers wait in, exactly
like a rank that is still computing; only its thread tells them apart. The
rank's watcher thread samples, every period, the CPU time (user + system,
``/proc/self/task/<id>/stat``) of the one thread that issued the rank's
collectives (recorded by the watch); a thread whose CPU time has not moved
since some sample has been idle at least since then, unless it is in
uninterruptible I/O (state ``D``: an ``fsync`` of a checkpoint, a read from
slow storage), which counts as busy. The value is a lower bound, and None
("unknown": the watch then judges as it did before) when the rank issued
collectives from more than one thread, before its first one, or where
``/proc`` cannot be read (not Linux). Ranks that are threads of one process
each sample their own thread. One file read per period, no store operation.
"""

from __future__ import annotations

import os
import time

__all__ = ["IdleClock", "thread_state"]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_UTIME = 11  # utime and stime: fields 14 and 15 of /proc/<pid>/stat, counted after the ")" ending the name


def thread_state(native_id: int) -> tuple[str, float] | None:
    """The state letter of the thread ``native_id`` of this process and the CPU seconds it has used; None where
    that cannot be read."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), (int(fields[_UTIME]) + int(fields[_UTIME + 1])) / _TICKS_PER_S
    except (OSError, IndexError, ValueError):
        return None


class IdleClock:
    """Samples one thread's CPU time; :meth:`sample` says for how long (at least) it has not moved."""

    def __init__(self) -> None:
        self._thread: int | None = None
        self._cpu_s: float | None = None
        self._since = 0.0  # when the CPU time was first seen at its current value

    def sample(self, thread: int | None) -> float | None:
        """Seconds ``thread`` has used no CPU, as far as the samples show (None: unknown)."""
        state = thread_state(thread) if thread else None
        now = time.monotonic()
        if state is None:
            self._thread = None
            return None
        letter, cpu_s = state
        if thread != self._thread or cpu_s != self._cpu_s or letter == "D":  # "D": busy in I/O
            self._thread, self._cpu_s, self._since = thread, cpu_s, now
        return now - self._since
