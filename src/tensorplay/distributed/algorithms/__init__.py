"""Distributed training algorithms. ``join`` is PyTorch's; ``model_averaging`` and
``ddp_comm_hooks`` are ours."""

from __future__ import annotations

from tensorplay import _alias


def __getattr__(name: str) -> object:
    return _alias.alias_attribute(__name__, name)
