"""The older import path of ``fully_shard`` and its policies: our objects of ``tensorplay.distributed.fsdp``."""

from __future__ import annotations

from tensorplay.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

from .fully_shard import FSDPModule, fully_shard, register_fsdp_forward_method

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "fully_shard",
    "register_fsdp_forward_method",
]
