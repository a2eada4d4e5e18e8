"""``Join`` for the classic wrapper: which group and device the join context counts ranks on.

The shadow step itself is shared with fully_shard (``fsdp/_join_shadow_step.py``,
[Note: join by shadow step]).
"""

from __future__ import annotations

from typing import Any

import torch

from .._join_shadow_step import ShardedJoinable, hybrid_join_group
from .sharding_plan import HYBRID_STRATEGIES
from .unit_state import state_of


class ClassicJoinable(ShardedJoinable):
    """``FullyShardedDataParallel``'s ``Joinable`` side: ``Join([model], optimizer=optim)`` with the root wrapper."""

    def _join_group_and_device(self) -> tuple[Any, torch.device]:
        strategy, device = self.sharding_strategy, self.compute_device  # type: ignore[attr-defined]
        state = state_of(self)  # type: ignore[arg-type]  # the wrapper (an nn.Module) mixes this in
        if strategy in HYBRID_STRATEGIES and state is not None:
            return hybrid_join_group(state.plan.data_parallel_size, f"sharding_strategy={strategy}"), device
        return self.process_group, device  # type: ignore[attr-defined]
