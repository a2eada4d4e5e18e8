"""A rank with a different model never reaches Gloo: every rank raises one clear ValueError naming the
ranks and the first difference, no process aborts, and the worker pool survives.

(PyTorch's fully_shard, classic FSDP and ZeRO abort rank 0's process inside Gloo here: "Received data
size doesn't match expected size"; there is no oracle to compare the error with, so the tests compare
with a run where every rank builds the same model.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

from tests.common import error_of

ODD_RANK = 1


def _model(wide: bool, extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6 if wide else 4)]
    if extra:
        layers += [nn.Linear(4, 4)]
    return nn.Sequential(*layers)


def _odd() -> bool:
    return dist.get_rank() == ODD_RANK


def _train_step(model: nn.Module) -> float:
    loss = model(tp.ones(2, 4)).sum()
    loss.backward()
    loss = loss.detach()
    return loss.item()


def fully_shard_case(odd: bool, extra: bool = False) -> None:
    from tensorplay.distributed.fsdp import fully_shard
    model = _model(wide=odd and not extra, extra=odd and extra)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    _train_step(model)


def classic_case(odd: bool, sync_module_states: bool = False) -> None:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
    from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
    model = FSDP(_model(wide=odd), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 sync_module_states=sync_module_states)
    _train_step(model)


def zero_case(odd: bool) -> None:
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer
    model = _model(wide=odd)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), tp.optim.SGD, lr=0.1)
    _train_step(model)
    optimizer.step()


CASES: dict[str, Callable[[bool], None]] = {
    "fully_shard": fully_shard_case,
    "fully_shard_extra_layer": lambda odd: fully_shard_case(odd, extra=True),
    "classic": classic_case,
    "classic_sync_module_states": lambda odd: classic_case(odd, sync_module_states=True),
    "zero": zero_case,
}


def run_case(name: str) -> dict[str, Any]:
    """The error with one rank's model different, then the same call with equal models (must pass)."""
    case = CASES[name]
    mismatch = error_of(lambda: case(_odd()))
    equal = error_of(lambda: case(False))
    return {"mismatch": mismatch, "equal": equal, "pid": os.getpid()}


def pid() -> int:
    return os.getpid()


EXPECTED = {
    "fully_shard": "rank 1 has '2.weight' of shape (6, 8), rank 0 (4, 8)",
    "fully_shard_extra_layer": "rank 1 has an extra '3.weight' (shape (4, 4), torch.float32), which rank 0 "
                               "does not have",
    "classic": "rank 1 has '2.weight' of shape (6, 8), rank 0 (4, 8)",
    "classic_sync_module_states": "rank 1 has 'weight' of shape (6, 8), rank 0 (4, 8)",
    "zero": "rank 1 has 'param 2 of group 0' of shape (6, 8), rank 0 (4, 8)",
}
WHAT = {
    "fully_shard": "fully_shard (first forward of the root",
    "fully_shard_extra_layer": "fully_shard (first forward of the root",
    "classic": "FullyShardedDataParallel (first forward of the root",
    "classic_sync_module_states": "FullyShardedDataParallel(Linear) construction",
    "zero": "ZeroRedundancyOptimizer construction",
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_different_model_raises_on_every_rank(name: str, world_size: int) -> None:
    before = run_distributed(pid, world_size=world_size)
    results = run_distributed(run_case, name, world_size=world_size, timeout=60)
    odd_ranks = [ODD_RANK]
    others = [r for r in range(world_size) if r not in odd_ranks]
    for rank, result in enumerate(results):
        assert result["mismatch"] is not None, (name, rank)
        kind, message = result["mismatch"]
        assert kind == "ValueError", (name, rank, message)
        assert WHAT[name] in message and EXPECTED[name] in message, (name, rank, message)
        assert f"Ranks {others} agree with rank 0; ranks {odd_ranks} differ" in message, (name, rank, message)
        assert result["equal"] is None, (name, rank, result["equal"])
    # Nobody aborted: the same worker processes served both calls and serve the next one.
    assert [r["pid"] for r in results] == before == run_distributed(pid, world_size=world_size)
