"""The frameworks people train with, on ours after ``use_as_torch()``, bitwise PyTorch's (2 Gloo ranks, CPU).

Cases in ``frameworks_cases``: accelerate's FSDP plugin (version 2), including its
checkpoint round trip; transformers' ``generate(synced_gpus=True)`` on a tiny Llama.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tensorplay.testing.distributed import run_distributed

from tests.parity.frameworks_cases import all_cases

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

OURS = "tensorplay.distributed.fsdp._fully_shard._fully_shard"


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(all_cases, world_size=2, timeout=300, fresh=True)


@pytest.mark.parametrize("case", ["accelerate_fsdp2", "transformers_generate"])
def test_framework_runs_on_ours_bitwise_pytorchs(results: list[dict[str, Any]], case: str) -> None:
    for rank in results:
        ours, theirs = rank[(case, "ours")], rank[(case, "torch")]
        assert ours["sharded_by"] == OURS and theirs["sharded_by"] != OURS  # the framework reached our code
        assert _equal({k: v for k, v in ours.items() if k != "sharded_by"},
                      {k: v for k, v in theirs.items() if k != "sharded_by"})


def test_accelerate_checkpoint_round_trip(results: list[dict[str, Any]]) -> None:
    assert results[0][("accelerate_fsdp2", "ours")]["saved"]  # rank 0 gets the full state dict, as in PyTorch
    for rank in results:
        ours = rank[("accelerate_fsdp2", "ours")]
        assert _equal(ours["loaded"], ours["saved"])
        assert all(bool(v.any()) for v in ours["loaded"].values())  # the zeroed parameters came back
