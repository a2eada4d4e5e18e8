"""The frameworks people train with, on ours, bitwise PyTorch's (4 Gloo ranks, CPU).

Cases in ``frameworks_cases``. With nothing switched: Lightning's ``FSDPStrategy`` and
transformers given our classic FSDP. After ``use_as_torch()``: accelerate's FSDP plugin
(versions 2 and 1) and Lightning Fabric's ModelParallelStrategy, each with its
checkpoint round trip; transformers' ``generate(synced_gpus=True)`` on a tiny Llama;
pipelining with 2 fully_shard stages x dp 2, GPipe and 1F1B; Lightning's
``FSDPStrategy`` optimizer state. One fresh set of processes runs them all
(framework imports are slow).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

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


def test_accelerate_fsdp1_upcasts_a_bf16_model_as_pytorchs(results: list[dict[str, Any]]) -> None:
    """accelerate's prepare upcast every unit of the bf16 model to fp32 (compared with PyTorch's above)."""
    for rank in results:
        ours = rank[("accelerate_fsdp1", "ours")]
        assert ours["flat_dtypes"] and set(ours["flat_dtypes"]) == set(ours["orig_dtypes"]) == {torch.float32}


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


@pytest.mark.parametrize(("case", "check"), [("lightning_fsdp", "not_wrapped_again"),
                                             ("transformers_fsdp1", "fsdp_managed")])
def test_framework_takes_our_classic_fsdp_for_pytorchs(results: list[dict[str, Any]], case: str, check: str) -> None:
    """With nothing switched, the framework's isinstance check takes our classic FSDP for PyTorch's (Lightning does
    not wrap it again; transformers calls it FSDP-managed), and every value is bitwise PyTorch's."""
    for rank in results:
        ours, theirs = rank[(case, "ours")], rank[(case, "torch")]
        assert ours["sharded_by"] == OURS_CLASSIC and theirs["sharded_by"].startswith("torch.distributed.fsdp")
        assert ours[check] is True and theirs[check] is True
        compared = theirs.keys() - {"sharded_by", "optimizer_state"}
        assert compared == ours.keys() - {"sharded_by", "optimizer_state"}
        assert equal_nested({k: ours[k] for k in compared}, {k: theirs[k] for k in compared})


def test_lightning_fsdp_checkpoint_and_optimizer_state(results: list[dict[str, Any]]) -> None:
    """Lightning's sharded checkpoint of our classic FSDP round-trips as PyTorch's does. Its optimizer state (PyTorch's
    ``FSDP.optim_state_dict``) refuses on ours, naming itself and the fix, until ``use_as_torch()``; then it is
    bitwise PyTorch's, as is the rest of the run."""
    for rank in results:
        ours, theirs = rank[("lightning_fsdp", "ours")], rank[("lightning_fsdp", "torch")]
        switched = rank[("lightning_fsdp_switched", "ours")]
        assert equal_nested(theirs["loaded"], theirs["saved"]) and equal_nested(ours["loaded"], theirs["saved"])
        assert re.fullmatch(r"ForeignFSDPHelperError: PyTorch's torch\.distributed\.fsdp\.fully_sharded_data_parallel\."
                            r"FullyShardedDataParallel\.optim_state_dict\(\) read _FSDPState\._use_orig_params, .* "
                            r"Call tensorplay\.distributed\.fsdp\.FullyShardedDataParallel\.optim_state_dict \(the "
                            r"same arguments\); .*use_as_torch\(\)\.", ours["optimizer_state"])
        assert isinstance(theirs["optimizer_state"], dict) and theirs["optimizer_state"]["state"]
        compared = switched.keys() - {"sharded_by"}  # training and the optimizer state (no second checkpoint)
        assert "optimizer_state" in compared and compared < theirs.keys()
        assert equal_nested({k: switched[k] for k in compared}, {k: theirs[k] for k in compared})
