"""Per-parameter FSDP: :func:`fully_shard`, :class:`FSDPModule` and their policies."""

from __future__ import annotations

from ._fsdp_api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
