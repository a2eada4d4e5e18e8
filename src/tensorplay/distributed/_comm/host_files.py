"""Files in ``/dev/shm`` that rank 0 of a group makes and every rank of the group opens by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["SHM_DIR", "path_from_rank0"]

SHM_DIR = "/dev/shm"
_PATH_BYTES = 256


def path_from_rank0(make: Callable[[], str], group: ProcessGroup, wait: Callable[[dist.Work], None]) -> str:
    """``make()`` run on group rank 0 (a path, or "" when it failed), sent to every rank: a collective."""
    name = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
    if dist.get_rank(group) == 0:
        path = make().encode()
        name[: len(path)] = torch.tensor(list(path), dtype=torch.uint8)
    wait(dist.broadcast(name, group=group, group_src=0, async_op=True))
    return bytes(name.tolist()).rstrip(b"\0").decode()
