"""A lost rank under 1-D fully_shard: its shard (parameters, optimizer state) comes from its buddy's copy,
the state is resharded over the survivors in memory, and they end on an uninterrupted run's parameters.

The kill inside the optimizer step lands after the commit, so the buddy replays the lost rank's update;
the others land before it, so the copy is used as it is. A rank lost together with its buddy makes every
survivor raise ShardsLost, saying exactly that.
"""

from __future__ import annotations

from tensorplay.distributed import survive
from tensorplay.distributed.fsdp import fully_shard
from tensorplay.testing.survive import Died, run_survivable

from .survive_cases import ENV, GLOBAL_BATCH, GROUP_TIMEOUT, Kills, check, data, net, sgd, train


def _build():
    module = net()  # its values are replaced by the resharded state after a regroup
    fully_shard(module)
    return module, sgd(module)


def _job() -> survive.Job:
    return survive.Job(_build, survive.Sampler(GLOBAL_BATCH, len(data()[0])), timeout=GROUP_TIMEOUT,
                       redundancy="buddy")


def _train(kills: Kills, joins: int = 0) -> dict:
    return train(_job, kills, joins=joins)


def _train_until_shards_lost(kills: Kills) -> str:
    try:
        train(_job, kills)
    except survive.ShardsLost as error:
        return str(error)
    return "no error"


def test_fully_shard_survives_kills_at_backward_optimizer_step_and_commit_rank0_included():
    # W = 4 -> 3 -> 2 -> 1; rank 0 dies inside step 3's optimizer step, after the commit: its buddy replays
    # that step on its copy; the others die before their step's commit: the copies are used as they are
    kills = {1: (1, "backward"), 0: (3, "optimizer step"), 3: (5, "commit")}
    survivors = check(run_survivable(_train, kills, world_size=4, timeout=120, env=ENV), kills)
    assert survivors[0]["seen"] == [([1], 1, [0, 2, 3]), ([0], 4, [2, 3]), ([3], 5, [2])]


def test_a_rank_lost_with_its_buddy_is_named_on_every_survivor():
    kills = {1: (1, "forward"), 2: (1, "forward")}
    outcome = run_survivable(_train_until_shards_lost, kills, world_size=4, timeout=90, env=ENV)
    assert isinstance(outcome[1], Died) and isinstance(outcome[2], Died)
    assert outcome[0] == outcome[3] == (
        "both copies of the shards of rank(s) [1] are lost (rank 1 and its buddy rank 2 were lost together); "
        "the job cannot carry on in-process: restart it from its last checkpoint (tprun --max-restarts)")
