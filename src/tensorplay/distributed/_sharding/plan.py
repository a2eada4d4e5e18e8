"""One sharding plan for every front end: which ranks split the state, which hold copies, when to reshard.

Classic FSDP (``_classic.sharding_plan.ShardingPlan``, with its strategy),
fully_shard (``_fully_shard._fsdp_common.MeshInfo``, with its mesh) and ZeRO
(over one group) each build a :class:`ShardPlan`:

============  ==================  ==================  =======================
front end     shard group         replicate group     reshard after forward
============  ==================  ==================  =======================
ZeRO          its process group   none                (parameters stay whole)
fully_shard   last mesh dim       first dim (HSDP)    the call's argument
classic FSDP  per strategy        per strategy        per strategy
============  ==================  ==================  =======================

Gradients are reduce-scattered over the shard group, then all-reduced over the
replicate group, and divided by the data-parallel size (split in two with
:meth:`ShardPlan.gradient_divide_factors`, or once after).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup

_Plan = TypeVar("_Plan", bound="ShardPlan")


@dataclass(frozen=True)
class RankGroup:
    """A process group and this rank's place in it; ``group=None`` is a group of one (this rank alone)."""

    group: ProcessGroup | None = None
    size: int = 1
    rank: int = 0

    @classmethod
    def of(cls, group: ProcessGroup | None) -> RankGroup:
        """``group`` with this rank's size and rank in it (None: a group of one)."""
        if group is None:
            return cls()
        return cls(group, dist.get_world_size(group), dist.get_rank(group))


@dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """Where a front end's state is split (shard group) and copied (replicate group), and when it is resharded.

    ``shard_group=None``: nothing is sharded (classic NO_SHARD); ``replicate_group=None``:
    no replicas to all-reduce with. ``reshard_after_forward``: free gathered parameters
    after forward (True) or keep them until after backward (False); fully_shard's
    setters change it per group at run time, the plan holds the value it was built
    with. ``post_forward``: the smaller group fully_shard reshards to after forward
    (``reshard_after_forward`` given as an int), else None.
    """

    shard_group: ProcessGroup | None
    shard_size: int = 1
    shard_rank: int = 0
    replicate_group: ProcessGroup | None = None
    replicate_size: int = 1
    reshard_after_forward: bool = True
    post_forward: RankGroup | None = None

    @classmethod
    def over(cls: type[_Plan], shard_group: ProcessGroup | None, replicate_group: ProcessGroup | None = None,
             **fields: Any) -> _Plan:
        """The plan sharding over ``shard_group`` and replicating over ``replicate_group``.

        Sizes and this rank's place are asked of the groups; ``fields`` sets the
        rest (a subclass's own fields too).
        """
        shard, replicate = RankGroup.of(shard_group), RankGroup.of(replicate_group)
        return cls(shard_group=shard_group, shard_size=shard.size, shard_rank=shard.rank,
                   replicate_group=replicate_group, replicate_size=replicate.size, **fields)

    @property
    def data_parallel_size(self) -> int:
        """How many ranks hold a different part or copy of the data: the divisor of the mean gradient."""
        return self.shard_size * self.replicate_size

    def gradient_divide_factors(self) -> tuple[float, float]:
        """``(pre, post)``: gradients are divided by ``pre`` before the reduction and ``post`` after.

        Splitting the mean's division keeps low-precision sums from overflowing;
        ``pre`` doubles from 1 while it divides the size and is below size / ``pre``
        (the factors PyTorch's FSDP uses).
        """
        world = self.data_parallel_size
        pre = 1
        while world % pre == 0 and world / pre > pre:
            pre *= 2
        return float(pre), world / pre
