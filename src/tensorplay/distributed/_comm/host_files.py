"""Files in ``/dev/shm`` that rank 0 of a group makes and every rank of the group opens by name.

Each name says which process made it (``tensorplay-<pid>-...``, ``tensorplay-barrier-<pid>-...``): a file a
killed job left behind can be told from a live job's, and a test looks only at its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["SHM_DIR", "made_by", "name_prefix", "path_from_rank0"]

SHM_DIR = "/dev/shm"
_PATH_BYTES = 256
_KINDS = ("", "barrier-")


def name_prefix(kind: str = "") -> str:
    """The prefix of the names this process gives its files (``kind``: "" for slots, "barrier-" for pipes)."""
    return f"tensorplay-{kind}{os.getpid()}-"


def made_by(pids: Iterable[int]) -> list[str]:
    """The names in ``/dev/shm`` of the files and directories the processes ``pids`` made (sorted)."""
    prefixes = tuple(f"tensorplay-{kind}{pid}-" for pid in pids for kind in _KINDS)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefixes)) if prefixes else []


def path_from_rank0(make: Callable[[], str], group: ProcessGroup, wait: Callable[[dist.Work], None],
                    remove: Callable[[str], None]) -> str:
    """``make()`` run on group rank 0 (a path, or "" when it failed), sent to every rank: a collective.

    When the sending fails (a peer died, or is elsewhere past the group's timeout), rank 0 removes what it
    made (``remove``) before the error goes on: no other rank knows its name.
    """
    name = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
    path = make() if dist.get_rank(group) == 0 else ""
    name[: len(path.encode())] = torch.tensor(list(path.encode()), dtype=torch.uint8)
    try:
        wait(dist.broadcast(name, group=group, group_src=0, async_op=True))
    except BaseException:
        if path:
            remove(path)
        raise
    return bytes(name.tolist()).rstrip(b"\0").decode()
