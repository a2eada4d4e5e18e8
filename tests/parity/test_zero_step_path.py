"""ZeRO's step hot path: where every rank broadcasts a bucket or a pack of small parameters a step issues only
the broadcasts (no error vote), and a failing step on one rank still makes every rank raise, naming it, in any
later step too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed._comm import agreement
from tensorplay.distributed.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from tensorplay.testing.distributed import run_distributed

from tests.common import error_of
from tests.parity.zero_common import batch, make_model


def _votes_in_step(optimizer: ZeroRedundancyOptimizer) -> int:
    """The agreements (``_comm.agreement``'s control all-gathers) one step issues."""
    calls = []
    original = agreement.all_gather_flat

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    agreement.all_gather_flat = counted
    try:
        optimizer.step()
    finally:
        agreement.all_gather_flat = original
    return len(calls)


def step_path(setup: str) -> dict[str, Any]:
    model = make_model()
    # "single": the first two parameters only, one per rank, so no rank has small parameters to pack.
    params = list(model.parameters())[:2] if setup == "single" else model.parameters()
    optimizer = ZeroRedundancyOptimizer(params, tp.optim.Adam, parameters_as_bucket_view=setup == "bucket", lr=0.01)
    outcomes: dict[str, Any] = {}
    for step in range(5):
        optimizer.zero_grad()
        model(batch(step)).pow(2).sum().backward()
        if step == 1:
            outcomes["votes"] = _votes_in_step(optimizer)
        elif step == 3:  # rank 1's step fails once; the next step works on both ranks again
            fail = dist.get_rank() == 1
            outcomes["failed"] = error_of(optimizer.step, closure=_failing if fail else None)
        else:
            outcomes[f"step{step}"] = error_of(optimizer.step)
    params = [p.detach().clone() for p in model.parameters()]
    gathered = [None] * dist.get_world_size()
    torch_dist.all_gather_object(gathered, params)
    outcomes["ranks_agree"] = all(all(torch.equal(a, b) for a, b in zip(ps, params, strict=True))
                                  for ps in gathered)
    return outcomes


def _failing() -> float:
    raise FloatingPointError(f"loss is nan on rank {dist.get_rank()}")


@pytest.mark.parametrize("setup", ["bucket", "packed", "single"])
def test_step_has_no_vote_where_the_outcome_rides_and_failures_still_reach_every_rank(setup):
    rank0, rank1 = run_distributed(step_path, setup, world_size=2)
    # Bucket views or packed small parameters: the outcome rides on the broadcasts; otherwise one agreement votes.
    assert rank0["votes"] == rank1["votes"] == (1 if setup == "single" else 0)
    assert rank1["failed"] == ("FloatingPointError", "loss is nan on rank 1")
    assert rank0["failed"][0] == "RuntimeError"
    assert "ZeroRedundancyOptimizer.step (the local optimizer step) failed on rank 1" in rank0["failed"][1]
    for rank in (rank0, rank1):
        assert rank["step4"] is None and rank["step2"] is None and rank["ranks_agree"]
