"""The one way to ask whether there is an accelerator, and which; the device a group's collectives take."""

from __future__ import annotations

import os

import torch

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup

#: Backends that run collectives on host tensors.
_HOST_BACKENDS = ("gloo", "mpi", "fake")


def current_accelerator() -> torch.device | None:
    """This process's current accelerator device (type and index), or None when there is none (CPU only)."""
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None  # is_available() said there is one
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def collective_device(group: ProcessGroup | None) -> torch.device:
    """Where ``group``'s backend takes small tensors: the CPU for Gloo (or a CPU-capable mix), else the
    current accelerator."""
    backend = str(dist.get_backend(group))
    if backend in _HOST_BACKENDS or "cpu:" in backend:
        return torch.device("cpu")
    accelerator = current_accelerator()
    return accelerator if accelerator is not None else torch.device("cpu")


def ranks_per_node() -> int | None:
    """How many ranks share this machine: torchrun's ``LOCAL_WORLD_SIZE``, else the accelerator count; None when
    neither tells."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if current_accelerator() is not None:
        return torch.accelerator.device_count()
    return None
