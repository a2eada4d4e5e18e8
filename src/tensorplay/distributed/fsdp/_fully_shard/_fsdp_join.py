"""``Join`` for fully_shard: which group and device the join context counts ranks on.

The shadow step itself is shared with the classic wrapper (``fsdp/_join_shadow_step.py``,
[Note: join by shadow step]).
"""

from __future__ import annotations

from typing import Any

import torch

from .._join_shadow_step import ShardedJoinable, hybrid_join_group


class FSDPJoinable(ShardedJoinable):
    """``FSDPModule``'s ``Joinable`` side: ``Join([model], optimizer=optim)`` with a fully_shard root."""

    def _join_group_and_device(self) -> tuple[Any, torch.device]:
        groups = self._fsdp_groups(recurse=True)  # type: ignore[attr-defined]
        if not groups:
            raise ValueError(f"Join: {type(self).__name__} has no sharded parameters under fully_shard; pass the "
                             f"fully_shard root of the model being trained")
        info, device = groups[0].mesh_info, groups[0].device
        if info.spmd_mesh is not None:
            raise ValueError(f"Join does not support fully_shard with dp_mesh_dims ({type(self).__name__}): shard "
                             f"over the data-parallel mesh only")
        if info.replicate_group is not None:
            return hybrid_join_group(info.data_parallel_size, f"{type(self).__name__} (HSDP)"), device
        return info.shard_group, device
