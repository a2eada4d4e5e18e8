"""Regrouping: close a process group that lost a rank, forget what ``_comm`` kept for it, start the next one.

[Note: regrouping]
``_comm`` keeps per-group state keyed weakly by the ``ProcessGroup`` (the watch, the
rank's watcher thread, the shared-memory arena and its pipe barrier). A group that
lost a rank must leave none of it waiting on the dead peer: :func:`close_groups`
drops our state of every group of this rank, aborts it and destroys c10d's. A
survivor blocked on a *live* peer that gave up wakes when that peer's sockets close:
on Gloo only when its ``ProcessGroupGloo`` is freed (``abort()`` does not close them),
and DDP's reducer keeps it alive past ``destroy_process_group`` (measured: the peer
woke when the process exited, not at the destroy). So in a collective we do not issue,
such a survivor wakes at the group's timeout; in ours, the watch names the dead rank
after its stall slice. :func:`open_default_group` starts the
default group of the next generation over a prefixed store, so keys of the old one
(the watch's, c10d's own) never meet the new one's.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import host_barrier, host_memory, watch

__all__ = ["close_groups", "forget_group", "open_default_group", "process_alive"]


def forget_group(group: ProcessGroup) -> None:
    """Drop ``_comm``'s state of ``group``: its watch, its arena (and pipe barrier), and the rank's watcher
    thread when ``group`` is the default group. Safe to call for a group ``_comm`` never saw."""
    watch._WATCHES.pop(group, None)
    host_memory._ARENAS.pop(group, None)  # the arena's pipe barrier closes its FIFOs when collected
    watcher = watch._WATCHERS.pop(group, None)
    if watcher is not None:
        watcher._stop.set()  # the thread ends at its next period; it holds the watcher only weakly
        watcher._watches.clear()  # nothing of the old group to publish or linger for at exit


def close_groups() -> None:
    """Abort and destroy every process group of this rank (the default one included), forgetting our state
    of each first. Returns at once even when a peer is dead; afterwards ``dist.is_initialized()`` is False."""
    if not dist.is_initialized():
        return
    groups = list(dist.distributed_c10d._world.pg_map)
    for group in groups:
        forget_group(group)
        with contextlib.suppress(RuntimeError):
            group.abort()  # closes the transport now: a peer blocked on this rank wakes with an error
    with contextlib.suppress(RuntimeError):
        dist.destroy_process_group()


def open_default_group(backend: str, store: Any, prefix: str, rank: int, world_size: int,
                       timeout: timedelta) -> None:
    """Start the default group over ``PrefixStore(prefix, store)``: one generation of a job that regroups."""
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                            timeout=timeout)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host (and pid namespace) runs: not gone, and not a zombie."""
    return host_barrier._alive(pid)
