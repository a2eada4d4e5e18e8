"""ZeRO's partition rules, in one process (the multi-rank parity tests check them against PyTorch's)."""

from __future__ import annotations

import pytest

import tensorplay as tp
from tensorplay.distributed._sharding.partition import (
    BucketAssignment,
    ddp_bucket_assignments,
    least_loaded_rank,
    sorted_greedy_partition,
)


def test_largest_first_onto_least_loaded_rank_ties_to_lowest_rank():
    # sorted: 9(1) 9(2) 5(0) 4(4) 1(3); loads go (9,0) (9,9) (14,9) (14,13) (14,14)
    assert sorted_greedy_partition([[5, 9, 9, 1, 4]], world_size=2) == [[[1, 0]], [[2, 4, 3]]]


def test_three_ranks_mixed_model():
    model = tp.nn.Sequential(tp.nn.Linear(8, 16), tp.nn.ReLU(), tp.nn.Linear(16, 4), tp.nn.LayerNorm(4))
    numels = [p.numel() for p in model.parameters()]
    assert numels == [128, 16, 64, 4, 4, 4]
    # 128->r0, 64->r1, 16->r2, 4(3)->r2, 4(4)->r2 (20 < 64), 4(5)->r2 (24 < 64)
    assert sorted_greedy_partition([numels], world_size=3) == [[[0]], [[2]], [[1, 3, 4, 5]]]


def test_loads_carry_over_between_groups():
    owned = sorted_greedy_partition([[10, 3], [4, 4, 4]], world_size=2)
    # group 0: 10->r0, 3->r1 ; group 1 starts from loads (10, 3): 4->r1 (7), 4->r1 (11), 4->r0 (14)
    assert owned == [[[0], [2]], [[1], [0, 1]]]
    # Adding a group never moves the tensors of the earlier groups.
    assert [r[0] for r in owned] == [r[0] for r in sorted_greedy_partition([[10, 3]], world_size=2)]


def test_every_tensor_owned_exactly_once_and_empty_ranks_allowed():
    owned = sorted_greedy_partition([[7], []], world_size=3)
    assert owned == [[[0], []], [[], []], [[], []]]
    numels = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    owned = sorted_greedy_partition([numels], world_size=4)
    assert sorted(i for rank in owned for i in rank[0]) == list(range(len(numels)))


def test_least_loaded_rank_skips_excluded():
    assert least_loaded_rank([3, 1, 1]) == 1
    assert least_loaded_rank([3, 1, 1], excluded={1}) == 2
    with pytest.raises(ValueError, match="every rank of 2 is excluded"):
        least_loaded_rank([0, 0], excluded={0, 1})


def test_ddp_buckets_whole_round_robin():
    assert ddp_bucket_assignments([[4], [2, 2], [1]], world_size=2) == [
        BucketAssignment(0, 0, 1, 0), BucketAssignment(1, 0, 2, 1), BucketAssignment(2, 0, 1, 0)]


def test_ddp_buckets_sharded_smallest_bucket_first():
    # total 21, threshold 10.5; bucket 1 (2) -> r0, bucket 2 (7) -> r1,
    # bucket 0 cut before its third 4 (8 + 4 >= 10.5): [0, 2) -> r0, [2, 3) -> r1 (r0 excluded)
    assert ddp_bucket_assignments([[4, 4, 4], [2], [6, 1]], world_size=2, shard_buckets=True) == [
        BucketAssignment(1, 0, 1, 0), BucketAssignment(2, 0, 2, 1),
        BucketAssignment(0, 0, 2, 0), BucketAssignment(0, 2, 3, 1)]


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        sorted_greedy_partition([[1]], world_size=0)
    with pytest.raises(ValueError, match="DDP bucket 1 has no parameters"):
        ddp_bucket_assignments([[1], []], world_size=2)
