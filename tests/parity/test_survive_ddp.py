"""A lost rank under DDP: the survivors regroup in their processes and end on an uninterrupted run's parameters.

Each run kills ranks at chosen moments of chosen steps (rank 0 included); the survivors' parameters after
the last step are compared with one process training on the whole global batch (the lost rank's samples
go to the survivors, so every step's global batch is the same).
"""

from __future__ import annotations

import tensorplay as tp
from tensorplay.distributed import survive
from tensorplay.testing.survive import run_survivable

from .survive_cases import GLOBAL_BATCH, GROUP_TIMEOUT, Kills, check, data, net, sgd, train


def _job() -> survive.Job:
    module = net()
    optimizer = sgd(module)  # over the module's tensors: it carries over to every generation's wrapper
    return survive.Job(lambda: (tp.nn.parallel.DistributedDataParallel(module), optimizer),
                       survive.Sampler(GLOBAL_BATCH, len(data()[0])), timeout=GROUP_TIMEOUT)


def _train(kills: Kills) -> dict:
    return train(_job, kills)


def test_ddp_survives_forward_and_optimizer_step_kills_rank0_included():
    kills = {0: (2, "forward"), 3: (4, "optimizer step")}
    survivors = check(run_survivable(_train, kills, world_size=4, timeout=90), kills)
    # rank 3 died inside step 4's optimizer step, after the commit: the survivors had completed step 4
    assert survivors[0]["seen"] == [([0], 2, [1, 2, 3]), ([3], 5, [1, 2])]


def test_ddp_survives_backward_and_commit_kills():
    kills = {1: (1, "backward"), 2: (3, "commit")}
    survivors = check(run_survivable(_train, kills, world_size=3, timeout=90), kills)
    assert survivors[0]["seen"] == [([1], 1, [0, 2]), ([2], 3, [0])]
