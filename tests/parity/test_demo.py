"""The main job (examples/demo.py, run by ``make demo``) trains on 2 ranks with all three optimizers."""

from __future__ import annotations

import sys
from pathlib import Path

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import demo  # noqa: E402


def run_demo_jobs() -> dict[str, list[float]]:
    rank = dist.get_rank()
    return {"zero": demo.train_zero(rank), "post_local_sgd": demo.train_post_local_sgd(rank),
            "fully_shard": demo.train_fully_shard(rank)}


def test_demo_trains_and_zero_matches_fully_shard():
    losses, _ = run_distributed(run_demo_jobs, world_size=2)
    # Same model, seed, data and Adam arithmetic: only the sharding differs.
    assert losses["zero"] == losses["fully_shard"]
    for name, curve in losses.items():
        assert len(curve) == demo.STEPS
        assert curve[-1] < 0.2 * curve[0], name
