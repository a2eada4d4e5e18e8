"""``Join`` for fully_shard: which group and device the join context counts ranks on.

The shadow step itself is shared with the classic wrapper (``fsdp/_join.py``,
[Note: join by shadow step]).
"""

from __future__ import annotations

from typing import Any

import torch

from .._join import ShardedJoinable


class FSDPJoinable(ShardedJoinable):
    """``FSDPModule``'s ``Joinable`` side: ``Join([model], optimizer=optim)`` with a fully_shard root."""

    def _join_group_and_device(self) -> tuple[Any, torch.device]:
        groups = self._fsdp_groups(recurse=True)  # type: ignore[attr-defined]
        if not groups:
            raise ValueError(f"Join: {type(self).__name__} has no sharded parameters under fully_shard; pass the "
                             f"fully_shard root of the model being trained")
        info = groups[0].mesh_info
        if info.replicate_group is not None or info.spmd_mesh is not None:
            raise ValueError(f"Join supports fully_shard over a 1-D data-parallel mesh; {type(self).__name__} is "
                             f"sharded over a {info.mesh.ndim}-D mesh (HSDP or dp_mesh_dims)")
        return info.shard_group, groups[0].device
