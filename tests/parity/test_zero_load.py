"""ZeroRedundancyOptimizer.load_state_dict is all or nothing: every problem in one error, on every rank,
and each rank's optimizer state bitwise unchanged; PyTorch's ZeRO (the reference that fails) loads a
wrong-shape state silently."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from tensorplay.testing.distributed import run_distributed

from tests.common import error_of
from tests.parity.zero_common import batch, make_model


def trained(cls: Any, bucket: bool) -> tuple[Any, Any]:
    model = make_model()
    optimizer = cls(model.parameters(), tp.optim.Adam, parameters_as_bucket_view=bucket, lr=0.01)
    for step in range(2):
        optimizer.zero_grad()
        model(batch(step)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def snapshot(optimizer: Any) -> dict[str, Any]:
    local = optimizer.optim.state_dict()
    return {"state": copy.deepcopy(local["state"]), "groups": copy.deepcopy(local["param_groups"]),
            "outer": copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["groups"] != b["groups"] or a["outer"] != b["outer"] or sorted(a["state"]) != sorted(b["state"]):
        return False
    return all(sorted(a["state"][i]) == sorted(b["state"][i])
               and all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])
               for i in a["state"])


def damaged(full: dict[str, Any]) -> dict[str, Any]:
    bad = copy.deepcopy(full)
    bad["param_groups"][0]["lr"] = 123.0
    bad["state"][0]["exp_avg"] = torch.zeros(3, 3)  # param 0 is 10 x 6
    bad["state"][5]["exp_avg_sq"] = torch.zeros(7)  # param 5 has 3 elements
    bad["state"][99] = {"step": torch.tensor(1.0)}
    return bad


def load_cases(bucket: bool) -> dict[str, Any]:
    _, optimizer = trained(ZeroRedundancyOptimizer, bucket)
    optimizer.consolidate_state_dict(to=0)
    full = optimizer.state_dict() if dist.get_rank() == 0 else None
    holder = [full]
    torch.distributed.broadcast_object_list(holder, src=0)
    full = holder[0]
    before = snapshot(optimizer)
    out: dict[str, Any] = {}
    out["both_bad"] = error_of(optimizer.load_state_dict, damaged(full))
    out["both_bad_unchanged"] = same(snapshot(optimizer), before)
    # Only rank 1's copy is damaged: rank 0's is fine, but it must refuse too.
    out["rank1_bad"] = error_of(optimizer.load_state_dict, damaged(full) if dist.get_rank() == 1 else full)
    out["rank1_bad_unchanged"] = same(snapshot(optimizer), before)
    out["not_a_state_dict"] = error_of(optimizer.load_state_dict, {"state": {}} if dist.get_rank() == 0 else full)
    out["good"] = error_of(optimizer.load_state_dict, full)
    out["good_unchanged"] = same(snapshot(optimizer), before)
    _, theirs = trained(TorchZeRO, bucket)
    wrong_shape = copy.deepcopy(full)
    wrong_shape["state"][0]["exp_avg"] = torch.zeros(3, 3)
    out["torch_loads_wrong_shape"] = error_of(theirs.load_state_dict, wrong_shape) is None
    return out


@pytest.mark.parametrize("bucket", [False, True])
def test_load_state_dict_all_or_nothing_on_every_rank(bucket):
    rank0, rank1 = run_distributed(load_cases, bucket, world_size=2)
    for rank, out in enumerate((rank0, rank1)):
        kind, message = out["both_bad"]
        assert kind == "StateDictLoadError"
        for text in ('size mismatch for state.0.exp_avg: copying a param with shape torch.Size([3, 3]) from '
                     'checkpoint, the shape in current model is torch.Size([10, 6])',
                     "size mismatch for state.5.exp_avg_sq: copying a param with shape torch.Size([7])",
                     "the shape in current model is torch.Size([3])",
                     "state.99 (no param group lists parameter id 99)", f"on rank {rank}", "nothing was loaded"):
            assert text in message, (rank, text, message)
        assert out["both_bad_unchanged"] and out["rank1_bad_unchanged"], rank
        assert out["good"] is None and out["good_unchanged"], rank  # the same values loaded back
        assert out["torch_loads_wrong_shape"], rank  # the reference: PyTorch's ZeRO takes it
    assert rank1["rank1_bad"][0] == "StateDictLoadError"
    assert "size mismatch for state.0.exp_avg" in rank1["rank1_bad"][1]
    assert rank0["rank1_bad"][0] == "StateDictLoadError"
    assert "The check also failed on rank(s) [1]" in rank0["rank1_bad"][1]
    assert "expected a full optimizer state dict" in rank0["not_a_state_dict"][1]
    assert "failed on rank(s) [0]" in rank1["not_a_state_dict"][1]
