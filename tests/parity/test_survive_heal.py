"""Healing: after a loss, a replacement started with TENSORPLAY_SURVIVE_JOIN=1 joins at a step boundary,
receives the state from its peers (no file system), and the job ends at W on an uninterrupted run's
parameters (W = 4 -> 3 -> 4 under fully_shard, 3 -> 2 -> 3 under DDP)."""

from __future__ import annotations

from tensorplay.testing.survive import run_survivable

from . import test_survive_ddp, test_survive_fully_shard
from .survive_cases import ENV, check


def test_fully_shard_heals_4_3_4():
    kills = {1: (1, "backward")}
    outcome = run_survivable(test_survive_fully_shard._train, kills, 1, world_size=4, joiners=1, timeout=150, env=ENV)
    survivors = check(outcome, kills, joins=1)
    assert len(survivors) == 4 and survivors[-1]["seen"] == []  # the replacement saw no loss


def test_ddp_heals_3_2_3():
    kills = {1: (1, "backward")}
    outcome = run_survivable(test_survive_ddp._train, kills, False, 1, world_size=3, joiners=1, timeout=150, env=ENV)
    survivors = check(outcome, kills, joins=1)
    assert len(survivors) == 3 and survivors[-1]["seen"] == []
