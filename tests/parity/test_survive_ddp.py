"""A lost rank under DDP: the survivors regroup in their processes and end on an uninterrupted run's parameters.

Each run kills ranks at chosen moments of chosen steps (forward, backward, just before the commit, inside
the optimizer step, rank 0 included); the survivors' parameters after the last step are compared with one
process training on the whole global batch (the same global batch every step: the lost rank's samples go
to the survivors).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

import tensorplay as tp
from tensorplay.distributed import survive
from tensorplay.testing.survive import Died, die, run_survivable

GLOBAL_BATCH = 12  # divisible by 4, 3, 2 and 1: every share is equal
STEPS = 7


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(48, 4, generator=generator), torch.randn(48, 1, generator=generator)


def _net() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _reference() -> list[torch.Tensor]:
    """One process, the whole global batch per step."""
    net, (x, y) = _net(), _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sampler = survive.Sampler(GLOBAL_BATCH, len(x))
    for step in range(STEPS):
        rows = sampler.indices(step, 0, 1)
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _arm(job: survive.Job, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
         kills: dict[int, tuple[int, str]]) -> Callable[[str], None]:
    """Make this rank die at its (step, moment), if it has one; returns the check for moments without a hook."""
    step, moment = kills.get(job.member_id, (-1, ""))

    def at(wanted: str) -> None:
        if job.step == step and moment == wanted:
            die()

    net.register_forward_pre_hook(lambda *_: at("forward"))
    net[0].weight.register_hook(lambda grad: at("backward"))
    optimizer.register_step_pre_hook(lambda *_: at("optimizer step"))
    return at


def _train(kills: dict[int, tuple[int, str]]) -> dict:
    net, (x, y) = _net(), _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    job = survive.Job(lambda: (tp.nn.parallel.DistributedDataParallel(net), optimizer),
                      survive.Sampler(GLOBAL_BATCH, len(x)), timeout=timedelta(seconds=4))
    at = _arm(job, net, optimizer, kills)
    seen = []
    while job.step < STEPS:
        try:
            with job.attempt():
                rows = job.indices()
                loss = torch.nn.functional.mse_loss(job.model(x[rows]), y[rows]) * job.weight()
                loss.backward()
                at("commit")
                job.commit()
        except survive.RankLost as lost:
            seen.append((lost.lost, lost.step, sorted(lost.doing)))
            job.recover(lost)
    return {"params": [p.detach().clone() for p in net.parameters()], "seen": seen, "world": job.world_size,
            "generation": job.generation}


def _check(outcome: list, kills: dict[int, tuple[int, str]]) -> list[dict]:
    survivors = [result for rank, result in enumerate(outcome) if rank not in kills]
    assert all(isinstance(outcome[rank], Died) for rank in kills)
    reference = _reference()
    for result in survivors:
        for ours, expected in zip(result["params"], reference, strict=True):
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
        for ours, first in zip(result["params"], survivors[0]["params"], strict=True):
            assert torch.equal(ours, first)  # every survivor holds the same completed step
        assert result["world"] == len(survivors) and result["generation"] == len(kills)
    return survivors


def test_ddp_survives_forward_and_optimizer_step_kills_rank0_included():
    kills = {0: (2, "forward"), 3: (4, "optimizer step")}
    survivors = _check(run_survivable(_train, kills, world_size=4, timeout=90), kills)
    # rank 3 died inside step 4's optimizer step, after the commit: the survivors had completed step 4
    assert survivors[0]["seen"] == [([0], 2, [1, 2, 3]), ([3], 5, [1, 2])]


def test_ddp_survives_backward_and_commit_kills():
    kills = {1: (1, "backward"), 2: (3, "commit")}
    survivors = _check(run_survivable(_train, kills, world_size=3, timeout=90), kills)
    assert survivors[0]["seen"] == [([1], 1, [0, 2]), ([2], 3, [0])]
