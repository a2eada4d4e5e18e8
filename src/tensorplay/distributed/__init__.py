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
    return _alias.alias_attribute(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(_torch_distributed)))


from tensorplay.distributed._as_torch import use_as_torch  # noqa: E402,F401  (opt-in: PyTorch's FSDP paths -> ours)
from tensorplay.distributed.estimate import estimate_memory  # noqa: E402,F401  (the memory planner)
