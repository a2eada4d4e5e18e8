"""Process groups, collectives, DDP, RPC, DeviceMesh, DTensor: PyTorch's c10d.

The names PyTorch's ``torch.distributed`` offers resolve to its own objects. The
subpackages ``optim``, ``fsdp``, ``algorithms.model_averaging`` and
``algorithms.ddp_comm_hooks`` are this repo's.
"""

from __future__ import annotations

from types import ModuleType as _ModuleType

import torch.distributed as _torch_distributed
from torch.distributed import *  # noqa: F401,F403  (the public c10d surface, same objects)

from tensorplay import _alias

# The star import also binds torch's submodules (``algorithms``, ``rpc`` ...) as
# attributes; drop them so each resolves through our import path instead, where
# ``algorithms`` is our package and ``rpc`` the aliased torch module.
for _name, _value in list(globals().items()):
    if issubclass(type(_value), _ModuleType) and not _name.startswith("_"):
        del globals()[_name]
del _name, _value


def __getattr__(name: str) -> object:
    if name == "estimate_memory":  # the memory planner (ours): imported when asked for, not by this c10d facade
        from tensorplay.distributed.estimate import estimate_memory

        return estimate_memory
    if name == "use_as_torch":  # the opt-in that makes PyTorch's FSDP paths resolve to ours (ours, imported when asked)
        from tensorplay.distributed._as_torch import use_as_torch

        return use_as_torch
    return _alias.alias_attribute(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(_torch_distributed)) | {"estimate_memory", "use_as_torch"})
