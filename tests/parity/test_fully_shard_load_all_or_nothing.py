"""fully_shard ``load_state_dict`` is all or nothing, on every rank (issue 13).

Two ranks, the tiny transformer sharded per block and at the root. A state dict
holding new values (the saved ones + 1) with a missing, an unexpected and a
wrong-shape key must raise one error listing all three (both shapes for the
wrong one) and leave every parameter bitwise unchanged on every rank; with
``strict=False`` missing / unexpected keys load the rest (as PyTorch does,
bitwise equal to its result) but a wrong shape is still refused; a wrong shape on
rank 1 only makes rank 0 refuse too. PyTorch's fully_shard is the reference that
half-loads: in each failing case some of its parameters changed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tensorplay.testing.distributed import run_distributed

from tests.common import error_of
from tests.parity._fsdp_models import build
from tests.parity.fully_shard_cases import fsdp_api

MISSING, WRONG = "layers.1.norm1.weight", "layers.0.fc1.weight"


def _sharded(impl: str) -> torch.nn.Module:
    api = fsdp_api(impl)
    model = build()
    for layer in model.layers:
        api.fully_shard(layer)
    api.fully_shard(model)
    return model


def _bad_state(model: torch.nn.Module, case: str, rank: int) -> dict[str, Any]:
    """New values for every key, then this case's damage."""
    state = {key: value + 1 for key, value in model.state_dict().items()}
    if case in ("all_bad", "lenient_wrong_shape"):
        del state[MISSING]
        state["bogus.weight"] = torch.zeros(2)
    if case in ("all_bad", "lenient_wrong_shape") or (case == "rank1_wrong_shape" and rank == 1):
        state[WRONG] = torch.zeros(3, 3)
    if case == "lenient_keys":
        del state[MISSING]
        state["bogus.weight"] = torch.zeros(2)
    return state


def load_case(impl: str, case: str) -> dict[str, Any]:
    import tensorplay.distributed as dist

    model = _sharded(impl)
    before = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    state = _bad_state(model, case, dist.get_rank())
    strict = not case.startswith("lenient")
    result: list[Any] = []
    error = error_of(lambda: result.append(model.load_state_dict(state, strict=strict)))
    after = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    keys = (sorted(result[0].missing_keys), sorted(result[0].unexpected_keys)) if result else None
    return {"error": error, "changed": changed, "params": after, "keys": keys}


def _wrong_shape_line(model_shape: str) -> str:
    return (f"size mismatch for {WRONG}: copying a param with shape torch.Size([3, 3]) from checkpoint, the shape in "
            f"current model is {model_shape}")


@pytest.fixture(scope="module")
def fc1_shape() -> str:
    return str(build().state_dict()[WRONG].shape)


@pytest.mark.parametrize("case", ["all_bad", "lenient_wrong_shape", "rank1_wrong_shape"])
def test_bad_load_changes_nothing_on_any_rank(case: str, fc1_shape: str) -> None:
    ours = run_distributed(load_case, "ours", case)
    theirs = run_distributed(load_case, "torch", case)
    for rank, got in enumerate(ours):
        assert got["error"] is not None, f"rank {rank}: ours loaded a bad state dict ({case})"
        kind, message = got["error"]
        assert kind == "StateDictLoadError" and "nothing was loaded" in message, message
        assert got["changed"] == [], f"rank {rank}: ours changed {got['changed']} before refusing ({case})"
        if case == "rank1_wrong_shape" and rank == 0:
            assert "failed on rank(s) [1]" in message, message
        else:
            assert _wrong_shape_line(fc1_shape) in message, message
        if case == "all_bad":
            assert f'Missing key(s) in state_dict: "{MISSING}"' in message, message
            assert 'Unexpected key(s) in state_dict: "bogus.weight"' in message, message
        if case == "lenient_wrong_shape":
            assert "Missing key" not in message and "Unexpected key" not in message, message
    # The reference half-loads: on some rank it changed parameters (on rank 0 of the rank-1-only case, all of them).
    assert any(r["changed"] for r in theirs), f"PyTorch's fully_shard changed nothing ({case}): the case is vacuous"
    if case == "rank1_wrong_shape":
        assert theirs[0]["error"] is None and theirs[1]["error"] is not None


def test_lenient_load_of_missing_and_unexpected_keys_matches_pytorch() -> None:
    ours = run_distributed(load_case, "ours", "lenient_keys")
    theirs = run_distributed(load_case, "torch", "lenient_keys")
    for rank, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert got["error"] is None and want["error"] is None, (got["error"], want["error"])
        assert got["keys"] == want["keys"] == ([MISSING], ["bogus.weight"])
        assert got["changed"] == want["changed"] and MISSING not in got["changed"] and got["changed"], rank
        assert set(got["params"]) == set(want["params"])
        for name in want["params"]:
            assert torch.equal(got["params"][name], want["params"][name]), f"rank {rank}: {name}"
