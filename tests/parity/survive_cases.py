"""What the survive tests share: a tiny model and data, the uninterrupted reference, the kill switches, and
one training loop under :class:`survive.Job` that every front end runs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from tensorplay.distributed import survive
from tensorplay.testing.survive import Died, die

GLOBAL_BATCH = 12  # divisible by 4, 3, 2 and 1: every share is equal
STEPS = 7
GROUP_TIMEOUT = timedelta(seconds=8)  # 4 s timed out in a loaded first forward
#: The watch compares the ranks after 1 s in a collective (5 by default): a dead peer is named sooner.
ENV = {"TENSORPLAY_STALL_S": "1"}
KILL_LOG = "TENSORPLAY_TEST_KILL_LOG"  # the variable naming a file a killed rank appends its kill time to

#: A kill plan: job id (first-generation rank) -> (step, moment); moments: "forward", "backward", "commit"
#: (after backward, before Job.commit), "optimizer step" (inside it, after the commit's agreement).
Kills = dict[int, tuple[int, str]]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(48, 4, generator=generator), torch.randn(48, 3, generator=generator)


def net() -> torch.nn.Sequential:
    """Output rows 3: fewer than 4 ranks, so a shard can be empty."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def sgd(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def reference(steps: int = STEPS) -> list[torch.Tensor]:
    """One process, the whole global batch every step."""
    module, (x, y) = net(), data()
    optimizer = sgd(module)
    sampler = survive.Sampler(GLOBAL_BATCH, len(x))
    for step in range(steps):
        rows = sampler.indices(step, 0, 1)
        torch.nn.functional.mse_loss(module(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in module.parameters()]


def arm(job: survive.Job, kills: Kills) -> Callable[[str], None]:
    """Hooks on the job's current model and optimizer that kill this rank at its (step, moment); returns the
    check for the moment without a hook ("commit")."""
    step, moment = kills.get(job.member_id, (-1, ""))

    def at(wanted: str) -> None:
        if job.step == step and moment == wanted:
            _note_kill_time()
            die()

    def mid_backward(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: at("backward"))  # the last layer's gradients are done, the first's not

    job.model.register_forward_pre_hook(lambda *_: at("forward"))
    getattr(job.model, "module", job.model)[0].register_forward_hook(mid_backward)  # DDP wraps the Sequential
    job.optimizer.register_step_pre_hook(lambda *_: at("optimizer step"))
    return at


def _note_kill_time() -> None:
    """Append this kill's wall time to the file ``KILL_LOG`` names, if any (bench/bench_survive.py sets it)."""
    log = os.environ.get(KILL_LOG)
    if log:
        with open(log, "a") as file:
            file.write(f"{os.environ['RANK']} {time.time()!r}\n")


def _store() -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)


def _wait_for_first_loss() -> None:
    """A replacement starts with the job; it asks to join once the first loss is settled (W -> W-1 -> W)."""
    _store().wait(["tensorplay_survive/g1/settled"], timedelta(seconds=120))


def _wait_for_replacements(count: int) -> None:
    """After a recovery, let the replacements ask to join before the (fast) remaining steps run out."""
    store, deadline = _store(), time.monotonic() + 120
    while store.add("tensorplay_survive/join/count", 0) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def train(make_job: Callable[[], survive.Job], kills: Kills, steps: int = STEPS, joins: int = 0) -> dict[str, Any]:
    """The loop of docs/failures.md; returns the whole parameters, the RankLost seen, the world at the end,
    and the wall time of the first completed step after each recovery."""
    if os.environ.get("TENSORPLAY_SURVIVE_JOIN") == "1":
        _wait_for_first_loss()
    job, (x, y) = make_job(), data()
    at, seen, resumed, recovered = arm(job, kills), [], [], []
    while job.step < steps:
        try:
            with job.attempt():
                rows = job.indices()
                loss = torch.nn.functional.mse_loss(job.model(x[rows]), y[rows]) * job.weight()
                loss.backward()
                at("commit")
                job.commit()
                if len(resumed) < len(seen):
                    resumed.append(time.time())
        except survive.RankLost as lost:
            seen.append((lost.lost, lost.step, sorted(lost.doing)))
            job.recover(lost)
            recovered.append((job.step, whole_parameters(job.model)))  # the step every survivor carries on from
            if joins:
                _wait_for_replacements(joins)
            at = arm(job, kills)  # the rebuilt model and optimizer need the switches too
    return {"params": whole_parameters(job.model), "seen": seen, "world": job.world_size,
            "generation": job.generation, "resumed": resumed, "recovered": recovered}


def whole_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def check(outcome: list[Any], kills: Kills, steps: int = STEPS, joins: int = 0) -> list[dict[str, Any]]:
    """The killed ranks died; after each recovery every survivor holds the reference's parameters of the step
    it carries on from; every survivor ends on the reference's parameters, all alike, at W - kills."""
    assert all(isinstance(outcome[rank], Died) for rank in kills)
    survivors = [result for rank, result in enumerate(outcome) if rank not in kills]
    expected = reference(steps)
    for step, params in (pair for result in survivors for pair in result["recovered"]):
        for ours, theirs in zip(params, reference(step), strict=True):  # no survivor kept an update of a
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)  # step the others abandoned
    for result in survivors:
        for ours, theirs in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        for ours, first in zip(result["params"], survivors[0]["params"], strict=True):
            assert torch.equal(ours, first)  # every survivor holds the same completed step
        assert result["world"] == len(survivors) and result["generation"] == len(kills) + joins
    return survivors
