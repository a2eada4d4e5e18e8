"""``Join`` for the classic wrapper: which group and device the join context counts ranks on.

The shadow step itself is shared with fully_shard (``fsdp/_join.py``,
[Note: join by shadow step]).
"""

from __future__ import annotations

from typing import Any

import torch

from .._join import ShardedJoinable
from .sharding_plan import HYBRID_STRATEGIES


class ClassicJoinable(ShardedJoinable):
    """``FullyShardedDataParallel``'s ``Joinable`` side: ``Join([model], optimizer=optim)`` with the root wrapper."""

    def _join_group_and_device(self) -> tuple[Any, torch.device]:
        strategy = self.sharding_strategy  # type: ignore[attr-defined]
        if strategy in HYBRID_STRATEGIES:
            raise ValueError(f"Join does not support sharding_strategy={strategy} (two process groups); use "
                             f"FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
        return self.process_group, self.compute_device  # type: ignore[attr-defined]
