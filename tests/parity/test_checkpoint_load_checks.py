"""All-or-nothing load_state_dict of ShardedGradScaler, the averagers and PostLocalSGDOptimizer.

Each gets a state dict with a missing, an unexpected and a wrong-shape (or
wrong-type) entry: ours raises one StateDictLoadError listing every key and
leaves the object's state bitwise unchanged; PyTorch's (the reference) is
shown half-loading or accepting the bad value.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager as TorchPeriodic
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGD

import tensorplay as tp
from tensorplay.distributed._checks.load_check import StateDictLoadError
from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from tensorplay.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)
from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tensorplay.distributed.optim import PostLocalSGDOptimizer
from tensorplay.testing.distributed import run_distributed


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _bad_scaler_state(good: dict) -> dict:
    bad = {key: value for key, value in good.items() if key not in ("growth_interval", "_growth_tracker")}
    bad["scale"] = 1024.0
    bad["backoff_factor"] = "half"
    bad["unknown"] = 1
    return bad


def test_sharded_grad_scaler_refuses_all_or_nothing() -> None:
    scaler = ShardedGradScaler(device="cpu", init_scale=8.0)
    scaler.scale(torch.ones(1))
    before = copy.deepcopy(scaler.state_dict())
    with pytest.raises(StateDictLoadError) as info:
        scaler.load_state_dict(_bad_scaler_state(before))
    message = str(info.value)
    assert "for ShardedGradScaler (nothing was loaded)" in message
    assert 'Missing key(s) in state_dict: "growth_interval", "_growth_tracker".' in message
    assert 'Unexpected key(s) in state_dict: "unknown".' in message
    assert "backoff_factor: expected a number, got str" in message
    assert isinstance(info.value, RuntimeError)
    assert _bitwise_equal(scaler.state_dict(), before) and scaler.get_scale() == 8.0
    scaler.load_state_dict({**before, "scale": 4.0})  # a good one still loads
    assert scaler.get_scale() == 4.0

    # PyTorch's sets the scale before failing on the first missing key: half loaded.
    theirs = TorchScaler(device="cpu", init_scale=8.0)
    theirs.scale(torch.ones(1))
    with pytest.raises(KeyError):
        theirs.load_state_dict(_bad_scaler_state(theirs.state_dict()))
    assert theirs.get_scale() == 1024.0


def _averager_rank() -> dict[str, Any]:
    results: dict[str, Any] = {}
    averagers = {"periodic": PeriodicModelAverager(period=2, warmup_steps=1),
                 "hierarchical": HierarchicalModelAverager({2: 2}, warmup_steps=1)}
    for name, averager in averagers.items():
        averager.step = 5
        assert averager.state_dict() == {"step": 5}
        messages = []
        for bad in ({}, {"step": 3, "period": 2}, {"step": -1}, {"step": 2.5}):
            try:
                averager.load_state_dict(bad)
                messages.append("")
            except StateDictLoadError as error:
                messages.append(str(error))
        results[name] = {"messages": messages, "step_after": averager.step}
        averager.load_state_dict({"step": 7})
        results[name]["step_loaded"] = averager.step
    # PyTorch's averagers have no state dict at all: a checkpoint cannot hold their step.
    results["torch_has_state_dict"] = hasattr(TorchPeriodic(period=2), "state_dict")
    return results


def test_averagers_save_and_refuse_bad_steps() -> None:
    for result in run_distributed(_averager_rank, world_size=2):
        assert result["torch_has_state_dict"] is False
        for name in ("periodic", "hierarchical"):
            missing, unexpected, negative, fractional = result[name]["messages"]
            assert 'Missing key(s) in state_dict: "step".' in missing
            assert 'Unexpected key(s) in state_dict: "period".' in unexpected
            assert "step: expected a non-negative int, got -1" in negative
            assert "got 2.5" in fractional
            assert result[name]["step_after"] == 5 and result[name]["step_loaded"] == 7


def _post_local_rank() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (opt_cls, avg_cls) in {"ours": (PostLocalSGDOptimizer, PeriodicModelAverager),
                                     "theirs": (TorchPostLocalSGD, TorchPeriodic)}.items():
        torch.manual_seed(0)
        model = tp.nn.Sequential(tp.nn.Linear(3, 4), tp.nn.Linear(4, 2))
        local = tp.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = opt_cls(local, avg_cls(period=2, warmup_steps=1))
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        before = copy.deepcopy(opt.state_dict())
        bad = copy.deepcopy(before)
        bad["state"][1]["momentum_buffer"] = torch.zeros(1)   # wrong shape (PyTorch's broadcasts it)
        bad["state"][9] = {"momentum_buffer": torch.zeros(2)}  # no parameter 9
        del bad["state"][0]["momentum_buffer"]                 # missing key
        bad["step"] = 4
        try:
            opt.load_state_dict(bad)
            message = ""
        except StateDictLoadError as error:
            message = str(error)
        results[name] = {"message": message, "unchanged": _bitwise_equal(opt.state_dict(), before),
                         "step": opt.averager.step}
        if name == "ours":
            bad_groups = copy.deepcopy(before)
            bad_groups["param_groups"][0]["params"] = [0, 1, 2]
            try:
                opt.load_state_dict(bad_groups)
            except StateDictLoadError as error:
                results[name]["groups"] = str(error)
            opt.load_state_dict({**before, "step": 6})
            results[name]["good_step"] = opt.averager.step
    return results


def test_post_local_sgd_refuses_all_or_nothing() -> None:
    for result in run_distributed(_post_local_rank, world_size=2):
        ours, theirs = result["ours"], result["theirs"]
        message = ours["message"]
        assert "for PostLocalSGDOptimizer (nothing was loaded)" in message
        assert 'Missing key(s) in state_dict: "state.0.momentum_buffer".' in message
        assert 'Unexpected key(s) in state_dict: "state.9".' in message
        assert ("size mismatch for state.1.momentum_buffer: copying a param with shape torch.Size([1]) from "
                "checkpoint, the shape in current model is torch.Size([4])") in message
        assert ours["unchanged"] and ours["step"] == 1
        assert "groups of [3] parameters, this optimizer has [4]" in ours["groups"]
        assert ours["good_step"] == 6
        # PyTorch's loads it: wrong-shape momentum, averager step moved.
        assert theirs["message"] == "" and not theirs["unchanged"] and theirs["step"] == 4
