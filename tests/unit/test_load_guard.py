"""The sharded modules' load pre-hook in one process: when it checks, what, and that it touches no plain module.

A stand-in for a sharded module (anything with the sharded modules' state
attribute, given the hook) and a recording check are enough to see the
mechanics; the multi-rank behaviour is in tests/parity/test_load_through_plain_parent.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from tensorplay.distributed._checks.load_check import LoadProblems, StateDictLoadError
from tensorplay.distributed.fsdp import _load_guard
from tensorplay.distributed.fsdp._load_guard import check_loads_through_parents, checked_whole_load


def _sharded_stand_in(*children: nn.Module) -> nn.Module:
    module = nn.Sequential(*children) if children else nn.Linear(3, 2)
    module.__dict__["_fsdp_state"] = object()  # what classic FSDP units and fully_shard modules carry
    check_loads_through_parents(module)
    return module


def _model() -> nn.Module:
    """A plain parent: head, then ``body`` (sharded) holding a sharded ``body.0``."""
    torch.manual_seed(0)
    model = nn.Module()
    model.head = nn.Linear(2, 3)
    model.body = _sharded_stand_in(_sharded_stand_in(), nn.Linear(2, 2))
    return model


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[nn.Module, list[str], bool]]:
    """Record each check (module, keys, strict) instead of running the collective one."""
    seen: list[tuple[nn.Module, list[str], bool]] = []

    def record(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
        seen.append((module, sorted(state_dict), strict))

    monkeypatch.setattr(_load_guard, "check_module_load", record)
    return seen


def _new_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value + 1 for key, value in model.state_dict().items()}


def test_a_walk_through_a_plain_parent_checks_the_outer_sharded_part_once(checks: list) -> None:
    model = _model()
    model.load_state_dict(_new_state(model))
    assert checks == [(model.body, ["0.bias", "0.weight", "1.bias", "1.weight"], False)]
    assert "load_state_dict" not in model.__dict__ and "load_state_dict" not in model.head.__dict__
    model.load_state_dict(_new_state(model))  # the next walk checks again (the marks belong to one walk)
    assert len(checks) == 2


def test_a_load_that_begins_at_the_sharded_module_is_left_to_its_own_method(checks: list) -> None:
    model = _model()
    model.body.load_state_dict(_new_state(model.body))
    assert checks == []


def test_the_checkpoint_path_checks_the_whole_state_once_with_strict(checks: list) -> None:
    model = _model()
    state = _new_state(model)
    with checked_whole_load(model, state, strict=True):
        model.load_state_dict(state)
    assert checks == [(model, sorted(state), True)]
    model.load_state_dict(state)  # outside the scope the hook checks again
    assert checks[1][0] is model.body


def test_a_refused_sharded_part_is_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
        raise StateDictLoadError("Sequential", LoadProblems(other=["wrong"]), rank=0)

    monkeypatch.setattr(_load_guard, "check_module_load", refuse)
    model = _model()
    before = {key: value.clone() for key, value in model.body.state_dict().items()}
    with pytest.raises(StateDictLoadError, match=r"for Sequential on rank 0 \(nothing was loaded\):\n\twrong"):
        model.load_state_dict(_new_state(model))
    assert all(torch.equal(value, before[key]) for key, value in model.body.state_dict().items())
    assert torch.equal(model.head.weight, _model().head.weight + 1)  # the plain head before it: nn.Module's
