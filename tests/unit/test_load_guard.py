"""The plain-parent load guard in one process: which modules are guarded, and what a guarded load does.

A stand-in for a sharded module (anything with the sharded modules' state
attribute) is enough to see the mechanics; the multi-rank behaviour is in
tests/parity/test_load_through_plain_parent.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tensorplay import _module_parents
from tensorplay._module_parents import parents
from tensorplay.distributed._checks.load_check import StateDictLoadError
from tensorplay.distributed.fsdp._load_guard import guard_ancestors, is_guarded


def _sharded_stand_in() -> nn.Module:
    module = nn.Linear(3, 2)
    module.__dict__["_fsdp_state"] = object()  # what classic FSDP units and fully_shard modules carry
    return module


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.head = nn.Linear(2, 2)
    model.body = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    return model


def test_registering_a_sharded_module_guards_its_parent_and_every_recorded_ancestor() -> None:
    model = _model()
    assert not is_guarded(model) and parents(model.body) == [model]
    model.body[1] = _sharded_stand_in()  # two levels down, after the ancestors were built
    assert is_guarded(model.body) and is_guarded(model)
    assert not is_guarded(model.body[1]) and not is_guarded(model.head)  # sharded modules check themselves
    outer = nn.Sequential(model)  # a guarded module registered under a new parent guards that too
    assert is_guarded(outer)


def test_a_guarded_load_is_all_or_nothing_and_keeps_strict_and_assign() -> None:
    model = _model()
    model.body[1] = _sharded_stand_in()
    good = {key: value + 1 for key, value in model.state_dict().items()}
    before = {key: value.clone() for key, value in model.state_dict().items()}
    bad = dict(good)
    del bad["body.0.bias"]
    bad["body.1.weight"] = torch.zeros(5, 5)
    with pytest.raises(StateDictLoadError, match=r'for Module \(nothing was loaded\):\n\tMissing key\(s\) in '
                       r'state_dict: "body\.0\.bias"\.\n\tsize mismatch for body\.1\.weight: copying a param '
                       r'with shape torch\.Size\(\[5, 5\]\)'):
        model.load_state_dict(bad)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    lenient = dict(good)
    del lenient["head.bias"]
    result = model.load_state_dict(lenient, strict=False)
    assert result.missing_keys == ["head.bias"] and torch.equal(model.head.weight, good["head.weight"])
    model.load_state_dict(good, assign=True)
    assert model.head.weight is not None and torch.equal(model.head.weight, good["head.weight"])


def test_a_users_own_instance_load_state_dict_is_left_alone() -> None:
    model = _model()
    model.__dict__["load_state_dict"] = lambda *args, **kwargs: "mine"
    guard_ancestors(model.body)
    model.body.add_module("2", _sharded_stand_in())
    assert model.load_state_dict({}) == "mine" and not is_guarded(model)


def test_a_load_through_an_ancestor_registered_before_import_warns() -> None:
    """The one gap: an ancestor whose registration was never recorded cannot be guarded; the sharded module
    says so when a load reaches it through one (here the record is dropped by hand)."""
    model = _model()
    model.body[1] = _sharded_stand_in()
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(state)  # recorded: checked, no warning
    del model.__dict__["load_state_dict"]
    _module_parents._PARENTS.pop(model.body)
    with pytest.warns(UserWarning, match=r"sharded Linear at 'body\.1' through a module registered before tensorplay"):
        model.load_state_dict(state)
