"""Sharding strategies as settings of one plan: what is sharded, over which group, when to reshard.

FULL_SHARD is the general case. The others only change the settings:

=====================  ===========  ===============  ======================
strategy               shard group  replicate group  reshard after forward
=====================  ===========  ===============  ======================
FULL_SHARD             all ranks    none             yes
SHARD_GRAD_OP          all ranks    none             no (after backward)
NO_SHARD               none         all ranks        no (after backward)
HYBRID_SHARD           intra-node   inter-node       yes
_HYBRID_SHARD_ZERO2    intra-node   inter-node       no (after backward)
=====================  ===========  ===============  ======================

Gradients are reduce-scattered over the shard group, then all-reduced over the
replicate group. The plan is the shared ``_sharding.plan.ShardPlan`` plus the strategy.

Over a group of one rank, FULL_SHARD and SHARD_GRAD_OP become NO_SHARD with
PyTorch's warning, as PyTorch does: a shard of everything is everything, and
NO_SHARD skips gathering into a second buffer (measured, issue model on one
rank: 79 ms a step as FULL_SHARD, 54 as NO_SHARD). The hybrid strategies keep
their groups: PyTorch switches them too, and then never all-reduces across
the replicas.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._sharding.devices import ranks_per_node
from tensorplay.distributed._sharding.plan import ShardPlan

from ..api import ShardingStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Strategies that shard within a group and replicate across groups.
HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

ProcessGroupArg = ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None


@dataclass(frozen=True, kw_only=True)
class ShardingPlan(ShardPlan):
    """The shared :class:`~tensorplay.distributed._sharding.plan.ShardPlan` with the strategy it was made from."""

    strategy: ShardingStrategy

    @property
    def process_group(self) -> ProcessGroup | None:
        """The group parameters are sharded over (HYBRID: within a node; NO_SHARD: the replicas)."""
        return self.shard_group if self.shard_group is not None else self.replicate_group

    @property
    def group_arg(self) -> ProcessGroupArg:
        """The ``process_group`` argument that recreates this plan (nested units share the groups)."""
        if self.strategy in HYBRID_STRATEGIES:
            assert self.shard_group is not None and self.replicate_group is not None
            return (self.shard_group, self.replicate_group)
        return self.shard_group if self.shard_group is not None else self.replicate_group


def make_plan(strategy: ShardingStrategy, process_group: ProcessGroupArg = None,
              device_mesh: DeviceMesh | None = None) -> ShardingPlan:
    """Resolve ``strategy`` and the group arguments into a :class:`ShardingPlan`."""
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a ShardingStrategy, got {strategy!r}")
    if device_mesh is not None and process_group is not None:
        raise ValueError("pass either process_group or device_mesh, not both")
    if strategy in HYBRID_STRATEGIES:
        return ShardingPlan.over(*_hybrid_groups(process_group, device_mesh), **_settings(strategy))
    group = _flat_group(process_group, device_mesh, strategy)
    if strategy is not ShardingStrategy.NO_SHARD and dist.get_world_size(group) == 1:
        warnings.warn(f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
                      stacklevel=3)  # PyTorch's words; make_plan -> FullyShardedDataParallel -> its caller
        strategy = ShardingStrategy.NO_SHARD
    if strategy is ShardingStrategy.NO_SHARD:
        return ShardingPlan.over(None, group, **_settings(strategy))
    return ShardingPlan.over(group, **_settings(strategy))


def _settings(strategy: ShardingStrategy) -> dict[str, Any]:
    return {"strategy": strategy, "reshard_after_forward": strategy in _RESHARD_AFTER_FORWARD}


def _flat_group(process_group: ProcessGroupArg, device_mesh: DeviceMesh | None,
                strategy: ShardingStrategy) -> ProcessGroup:
    if isinstance(process_group, tuple):
        raise ValueError(f"a (shard_group, replicate_group) tuple is only valid with HYBRID_SHARD, got {strategy.name}")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(f"{strategy.name} needs a 1D device_mesh, got {device_mesh.ndim}D; "
                             "2D meshes are for HYBRID_SHARD")
        return device_mesh.get_group(0)
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None, "the default process group is not initialised"
    return group


def _hybrid_groups(process_group: ProcessGroupArg, device_mesh: DeviceMesh | None) -> tuple[ProcessGroup, ProcessGroup]:
    """(shard group, replicate group) from a tuple, a 2D mesh (replicate, shard), or the node layout."""
    if isinstance(process_group, tuple):
        if len(process_group) != 2:
            raise ValueError("HYBRID_SHARD process_group must be a (shard_group, replicate_group) tuple, "
                             f"got a tuple of {len(process_group)}")
        return process_group
    if device_mesh is not None:
        if device_mesh.ndim != 2:
            raise ValueError(f"HYBRID_SHARD needs a 2D device_mesh (replicate, shard), got {device_mesh.ndim}D")
        return device_mesh.get_group(1), device_mesh.get_group(0)
    if process_group is not None:
        raise ValueError("HYBRID_SHARD takes process_group=(shard_group, replicate_group), a 2D device_mesh, "
                         "or neither (groups per node); a single group is ambiguous")
    per_node = ranks_per_node()
    if per_node is None:
        raise ValueError("HYBRID_SHARD cannot tell how many ranks share a node (no LOCAL_WORLD_SIZE, no "
                         "accelerator); pass process_group=(shard_group, replicate_group) or a 2D device_mesh")
    return _groups_per_node(per_node)


def _groups_per_node(per_node: int) -> tuple[ProcessGroup, ProcessGroup]:
    world, rank = dist.get_world_size(), dist.get_rank()
    if per_node < 1 or world % per_node != 0:
        raise ValueError(f"HYBRID_SHARD: world size {world} is not a multiple of {per_node} ranks per node")
    shard_group = replicate_group = None
    for start in range(0, world, per_node):  # every rank must create every group
        group = dist.new_group(list(range(start, start + per_node)))
        if start <= rank < start + per_node:
            shard_group = group
    for offset in range(per_node):
        group = dist.new_group(list(range(offset, world, per_node)))
        if rank % per_node == offset:
            replicate_group = group
    assert shard_group is not None and replicate_group is not None
    return shard_group, replicate_group
