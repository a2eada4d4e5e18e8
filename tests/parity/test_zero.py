"""ZeroRedundancyOptimizer: bitwise parity with DDP + the plain optimizer and with PyTorch's ZeRO, 1 to 3 ranks."""

from __future__ import annotations

import pytest
import torch

from tensorplay.testing.distributed import run_distributed

from tests.parity.zero_common import assert_same_params, train, train_all

GRID = [
    {"opt": "adam", "small_numel": 20},
    {"opt": "sgd"},
    {"opt": "adam", "bucket": True},
    {"opt": "sgd", "bucket": True, "unit_numel": 50},
    {"opt": "adam", "bucket": True, "unit_numel": 50},
    {"opt": "adam", "bucket": True, "chunk_numel": 64},
    {"opt": "sgd", "chunk_numel": 64},
]


def grid_runs(grid: list[dict]) -> list[dict]:
    return [train_all(**config) for config in grid]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plain_and_bucket_view_match_ddp_and_pytorch(world_size):
    per_rank = run_distributed(grid_runs, GRID, world_size=world_size)
    for index, config in enumerate(GRID):
        results = [rank_runs[index] for rank_runs in per_rank]
        assert_same_params(results)
        # The partition is PyTorch's, rank by rank.
        assert results[0]["ours"]["partition"] == results[0]["torch"]["partition"], config
        owned = sorted(i for rank in results[0]["ours"]["partition"] for i in rank[0])
        assert owned == list(range(6)), config


FEATURES = [
    {"opt": "adam", "scheduler": True},
    {"opt": "adam", "add_group_at": 2},
    {"opt": "sgd", "add_group_at": 1, "bucket": True},
    {"opt": "adamw", "frozen": True, "bucket": True, "unit_numel": 50},
    {"opt": "adam", "unused": True},
    {"opt": "adamw", "frozen": True, "bucket": True, "scheduler": True, "chunk_numel": 64},
]


def test_scheduler_add_param_group_frozen_and_unused_params_two_ranks():
    per_rank = run_distributed(grid_runs, FEATURES, world_size=2)
    for index, config in enumerate(FEATURES):
        results = [rank_runs[index] for rank_runs in per_rank]
        assert_same_params(results)
        assert results[0]["ours"]["partition"] == results[0]["torch"]["partition"], config


def test_add_param_group_three_ranks():
    per_rank = run_distributed(grid_runs, [{"opt": "adam", "add_group_at": 2, "bucket": True}], world_size=3)
    assert_same_params([runs[0] for runs in per_rank])


def mixed_dtypes() -> dict:
    # PyTorch's ZeRO refuses mixed dtypes; ours buckets per (device, dtype): compare with DDP + Adam.
    return {impl: train(impl, opt="adam", bucket=True, mixed_dtype=True) for impl in ("ours", "plain")}


def test_mixed_dtypes_bucket_view_match_ddp():
    results = run_distributed(mixed_dtypes, world_size=2)
    assert_same_params(results, impls=("ours", "plain"))
    assert results[0]["ours"]["params"][-1].dtype == torch.float64
