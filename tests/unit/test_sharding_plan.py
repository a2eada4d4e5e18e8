"""The one sharding plan (tensorplay.distributed._sharding.plan) and the front ends' plans built on it."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from tensorplay.distributed._sharding.plan import RankGroup, ShardPlan
from tensorplay.distributed.fsdp._classic.sharding_plan import ShardingPlan
from tensorplay.distributed.fsdp._fully_shard._fsdp_common import MeshInfo, PostForwardInfo


@pytest.mark.parametrize("shard,replicate", [(1, 1), (2, 1), (4, 1), (2, 2), (8, 1), (6, 1), (3, 4), (16, 2)])
def test_divide_factors_match_pytorchs_fsdp(shard, replicate):
    plan = ShardPlan(shard_group=None, shard_size=shard, replicate_size=replicate)
    world = shard * replicate
    pre = DefaultState._get_gradient_predivide_factor(world)
    assert plan.data_parallel_size == world
    assert plan.gradient_divide_factors() == (pre, world / pre)


def test_no_group_is_a_group_of_one():
    assert RankGroup.of(None) == RankGroup(None, 1, 0)
    plan = ShardPlan.over(None)
    assert (plan.shard_size, plan.shard_rank, plan.replicate_size) == (1, 0, 1)
    assert plan.reshard_after_forward and plan.post_forward is None


def test_front_end_plans_are_the_shared_plan():
    assert issubclass(ShardingPlan, ShardPlan) and issubclass(MeshInfo, ShardPlan)
    assert PostForwardInfo is RankGroup
    shared = {f.name for f in dataclasses.fields(ShardPlan)}
    assert {f.name for f in dataclasses.fields(ShardingPlan)} - shared == {"strategy"}
    assert {f.name for f in dataclasses.fields(MeshInfo)} - shared == {"mesh", "spmd_mesh", "dp_mesh_dims"}
