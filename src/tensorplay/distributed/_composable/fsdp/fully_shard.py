"""The older module path of ``fully_shard``: our objects of ``tensorplay.distributed.fsdp``."""

from __future__ import annotations

from tensorplay.distributed.fsdp import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
