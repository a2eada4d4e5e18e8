"""A lost rank under DDP: the survivors regroup in their processes and end on an uninterrupted run's parameters.

One run kills three ranks in turn at chosen moments (rank 0 included); the survivor's parameters after
the last step are compared with one process training on the whole global batch (the lost rank's samples
go to the survivors, so every step's global batch is the same).
"""

from __future__ import annotations

import tensorplay as tp
from tensorplay.distributed import survive
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay.testing.survive import run_survivable

from .survive_cases import ENV, GLOBAL_BATCH, GROUP_TIMEOUT, Kills, check, data, net, sgd, train


def _job(hook: bool = False) -> survive.Job:
    module = net()
    optimizer = sgd(module)  # over the module's tensors: it carries over to every generation's wrapper

    def build():
        model = tp.nn.parallel.DistributedDataParallel(module)
        if hook:  # our all-reduce: watched, so a survivor blocked on a live peer that gave up is woken
            model.register_comm_hook(None, allreduce_hook)
        return model, optimizer

    return survive.Job(build, survive.Sampler(GLOBAL_BATCH, len(data()[0])), timeout=GROUP_TIMEOUT)


def _train(kills: Kills, hook: bool = False, joins: int = 0) -> dict:
    return train(lambda: _job(hook), kills, joins=joins)


def test_ddp_survives_kills_at_forward_commit_and_optimizer_step_rank0_included():
    # W = 4 -> 3 -> 2 -> 1; rank 1 dies inside step 4's optimizer step, after the commit: the survivor had
    # completed step 4 and carries on from 5; the others die before their step's commit: it is retried
    kills = {0: (1, "forward"), 3: (2, "commit"), 1: (4, "optimizer step")}
    survivors = check(run_survivable(_train, kills, world_size=4, timeout=120, env=ENV), kills)
    assert survivors[0]["seen"] == [([0], 1, [1, 2, 3]), ([3], 2, [1, 2]), ([1], 5, [2])]
