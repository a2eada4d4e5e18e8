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

from . import host_memory, watch
from .host_barrier import pid_alive

__all__ = ["close_groups", "forget_group", "open_default_group", "pid_alive"]


def forget_group(group: ProcessGroup) -> None:
    """Drop ``_comm``'s state of ``group``: its watch, its arena (and pipe barrier), and the rank's watcher
    thread when ``group`` is the default group. Safe to call for a group ``_comm`` never saw."""
    watch.forget(group)
    host_memory.forget(group)


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
