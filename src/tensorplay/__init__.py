"""tensorplay: a distributed training layer on a PyTorch tensor core.

``tp.Tensor``, ``tp.randn``, ``tp.nn``, ``tp.optim`` ... are PyTorch's own objects
(see ``tensorplay._alias``); ``tensorplay.distributed.optim`` and
``tensorplay.distributed.fsdp`` (and the model-averaging and DDP-hook packages)
are written here, as are ``tp.save`` / ``tp.load`` (PyTorch's, plus an integrity
check on load) and ``tensorplay.distributed.checkpoint``.
"""

from __future__ import annotations

import torch as _torch

from tensorplay import _alias

_alias.install()

from tensorplay._serialization import load, save  # noqa: E402, F401  (after install(): ours, checked load, atomic save)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    return _alias.alias_attribute(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(_torch)))
