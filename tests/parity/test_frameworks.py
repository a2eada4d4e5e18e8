"""The frameworks people train with, on ours after ``use_as_torch()``, bitwise PyTorch's (4 Gloo ranks, CPU).

Cases in ``frameworks_cases``: accelerate's FSDP plugin (versions 2 and 1) and Lightning
Fabric's ModelParallelStrategy, each with its checkpoint round trip; transformers'
``generate(synced_gpus=True)`` on a tiny Llama; pipelining with 2 fully_shard
stages x dp 2, GPipe and 1F1B. One fresh set of processes runs them all
(framework imports are slow).
"""

from __future__ import annotations

from typing import Any

import pytest

from tensorplay.testing.distributed import run_distributed

from tests.parity.frameworks_cases import all_cases, equal_nested

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

OURS = "tensorplay.distributed.fsdp._fully_shard._fully_shard"
OURS_CLASSIC = "tensorplay.distributed.fsdp._classic.fully_sharded_data_parallel"


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(all_cases, world_size=4, timeout=400, fresh=True)


@pytest.mark.parametrize("case", ["accelerate_fsdp2", "accelerate_fsdp1", "lightning_model_parallel",
                                  "transformers_generate", "pipelining_ScheduleGPipe", "pipelining_Schedule1F1B"])
def test_framework_runs_on_ours_bitwise_pytorchs(results: list[dict[str, Any]], case: str) -> None:
    expected = OURS_CLASSIC if case == "accelerate_fsdp1" else OURS
    for rank in results:
        ours, theirs = rank[(case, "ours")], rank[(case, "torch")]
        assert ours["sharded_by"] == expected and not theirs["sharded_by"].startswith("tensorplay.")
        compared = theirs.keys() - {"sharded_by"}  # PyTorch's classic FSDP run stops before the checkpoint on CPU
        assert compared <= ours.keys() and (case == "accelerate_fsdp1" or ours.keys() == theirs.keys())
        assert equal_nested({k: ours[k] for k in compared}, {k: theirs[k] for k in compared})


@pytest.mark.parametrize("case", ["accelerate_fsdp2", "accelerate_fsdp1", "lightning_model_parallel"])
def test_checkpoint_round_trip(results: list[dict[str, Any]], case: str) -> None:
    assert results[0][(case, "ours")]["saved"]  # rank 0 gets the full state dict (accelerate: only rank 0)
    for rank in results:
        ours = rank[(case, "ours")]
        assert equal_nested(ours["loaded"], ours["saved"])
        assert all(bool(v.any()) for v in ours["loaded"].values())  # the zeroed parameters came back
        if "saved_optim" in ours:  # accelerate: the zeroed optimizer state came back too (v1: from rank 0 only)
            assert equal_nested(ours["loaded_optim"], ours["saved_optim"])
            assert all(bool(v.any()) for v in ours["loaded_optim"])
