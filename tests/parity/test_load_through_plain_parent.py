"""Loads into a plain module holding sharded ones (issue 13; without global hooks since issue 38).

Two ranks. The tiny transformer, wrapped in classic FSDP or sharded with
fully_shard (its blocks and itself, never the parent), sits between two plain
linears: in an ``nn.Sequential`` (registered at construction), or two levels
down in a model whose child is replaced by the wrapped one afterwards. A state
dict of new values (a non-distributed model's + 1) loads bitwise equal to the
non-distributed run, through the parent's ``load_state_dict`` and PyTorch's alike.

The parent's ``load_state_dict`` is ``nn.Module``'s and we leave it alone (see
[Note: load through a plain parent]): a wrong shape inside the sharded part, on
every rank or on rank 1 only, raises one ``StateDictLoadError`` on every rank
before any of the sharded part changes on any rank (PyTorch's: rank 0 loads
while rank 1 raises). Plain keys stay ``nn.Module``'s, as in PyTorch (the
control). The whole model all or nothing, plain keys included, is the checkpoint
package's ``set_model_state_dict``: with a missing plain key, an unexpected key
and a wrong-shape key inside the sharded part, or a wrong-shape plain key on rank
1 only, one ``StateDictLoadError`` on every rank lists every bad key with both
shapes, and no parameter changes on any rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tensorplay.testing.distributed import run_distributed

from tests.common import error_of
from tests.parity.classic_fsdp_cases import make_model, wrap_model

INNER = "layers.1.linear1.weight"
SHAPE = torch.Size(make_model().get_parameter(INNER).shape)
LAYOUTS = ("sequential", "deep")


class Outer(nn.Module):
    """A model whose sharded part is ``body.1``, one level below a plain child."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), inner)
        self.tail = nn.Linear(4, 3)


def _plain(layout: str) -> nn.Module:
    """The parent, unsharded (the non-distributed run), with fixed values."""
    torch.manual_seed(1)
    head, tail = nn.Linear(4, 4), nn.Linear(4, 3)
    if layout == "sequential":
        return nn.Sequential(head, make_model(), tail)
    model = Outer(make_model())
    model.head, model.tail = head, tail
    return model


def _sharded_part(kind: str, impl: str, model: nn.Module) -> nn.Module:
    if kind == "classic":
        return wrap_model(impl, {})  # make_model() wrapped per block and at its root
    from tests.parity.fully_shard_cases import fsdp_api as fully_shard_api

    api = fully_shard_api(impl)
    for layer in model.layers:
        api.fully_shard(layer)
    api.fully_shard(model)
    return model


def _parent(kind: str, impl: str, layout: str) -> nn.Module:
    """``_plain(layout)`` with its transformer sharded in place, the parent itself never wrapped."""
    model = _plain(layout)
    if layout == "sequential":
        sharded = _sharded_part(kind, impl, model[1])
        return nn.Sequential(model[0], sharded, model[2])  # registered at construction
    model.body[1] = _sharded_part(kind, impl, model.body[1])  # replaced two levels down, after the fact
    return model


def _prefix(layout: str) -> str:
    return "1." if layout == "sequential" else "body.1."


def _plain_keys(layout: str) -> tuple[str, str]:
    """(a key of the plain linear loaded before the sharded part, one loaded after it)."""
    return ("0.bias", "2.weight") if layout == "sequential" else ("head.bias", "tail.weight")


def _new_state(layout: str) -> dict[str, torch.Tensor]:
    return {key: value + 1 for key, value in _plain(layout).state_dict().items()}


def _as_model_holds(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each value the model holds as a DTensor distributed the same way (fully_shard loads
    DTensors; collective, every rank in the same key order)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    current = model.state_dict()
    return {key: distribute_tensor(value, current[key].device_mesh, current[key].placements)
            if isinstance(current.get(key), DTensor) else value for key, value in state.items()}


def _damage(state: dict[str, Any], case: str, layout: str, rank: int) -> None:
    before, after = _plain_keys(layout)
    if case in ("all_three", "lenient"):
        del state[before]
        state["bogus.weight"] = torch.zeros(2)
        if case == "all_three":
            state[_prefix(layout) + INNER] = torch.zeros(3, 5)
    elif case == "rank1_wrong_shape" and rank == 1:
        state[after] = torch.zeros(2, 2)
    elif case == "inner_wrong_shape" or (case == "rank1_inner_wrong_shape" and rank == 1):
        state[_prefix(layout) + INNER] = torch.zeros(3, 5)


def _local_values(model: nn.Module) -> list[torch.Tensor]:
    """This rank's parameters (flat shards, DTensor shards) and buffers, copied."""
    values = [*model.parameters(), *model.buffers()]
    return [(v.to_local() if hasattr(v, "to_local") else v).detach().clone() for v in values]


def _full_state(kind: str, impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state, unsharded (collective)."""
    state = model.state_dict()  # classic: FULL_STATE_DICT, the default
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _sharded_of(model: nn.Module, layout: str) -> nn.Module:
    return model.get_submodule(_prefix(layout)[:-1])


def load_case(kind: str, impl: str, layout: str, case: str, strict: bool = True,
              through: str = "parent") -> dict[str, Any]:
    """Load the damaged new state into the parent: its own ``load_state_dict`` or ``set_model_state_dict``."""
    import tensorplay.distributed as dist
    from tensorplay.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model = _parent(kind, impl, layout)
    if through == "parent":
        state = _as_model_holds(model, _new_state(layout))
    else:  # full tensors, the checkpoint package's (new values: a load that copied anything would show)
        options = StateDictOptions(full_state_dict=True, strict=strict)
        state = {key: value + 1 for key, value in get_model_state_dict(model, options=options).items()}
    _damage(state, case, layout, dist.get_rank())
    before, sharded_before = _local_values(model), _local_values(_sharded_of(model, layout))
    result: list[Any] = []
    if through == "parent":
        error = error_of(lambda: result.append(model.load_state_dict(state, strict=strict)))
    else:
        error = error_of(lambda: result.append(set_model_state_dict(model, state, options=options)))
    after, sharded_after = _local_values(model), _local_values(_sharded_of(model, layout))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    sharded_unchanged = all(torch.equal(a, b) for a, b in zip(sharded_before, sharded_after, strict=True))
    full = _full_state(kind, impl, model) if case in ("none", "lenient") else None
    keys = (list(result[0].missing_keys), list(result[0].unexpected_keys)) if result else None
    return {"error": error, "unchanged": unchanged, "sharded_unchanged": sharded_unchanged, "full": full,
            "keys": keys}


@pytest.mark.parametrize("kind", ["classic", "fully_shard"])
def test_a_good_load_through_a_plain_parent_equals_the_non_distributed_run(kind: str) -> None:
    for layout in LAYOUTS:
        reference = _plain(layout)
        reference.load_state_dict(_new_state(layout))
        want = reference.state_dict()
        for impl in ("ours", "torch"):
            for rank, got in enumerate(run_distributed(load_case, kind, impl, layout, "none")):
                assert got["error"] is None and not got["unchanged"], (impl, layout, rank, got["error"])
                assert got["full"].keys() == want.keys(), (impl, layout)
                for key, value in want.items():
                    assert torch.equal(got["full"][key], value), (impl, layout, rank, key)


@pytest.mark.parametrize("kind", ["classic", "fully_shard"])
def test_a_wrong_shape_in_the_sharded_part_changes_none_of_it_on_any_rank(kind: str) -> None:
    """The parent's own ``load_state_dict``: the sharded part refuses on every rank, PyTorch's splits the ranks."""
    for layout in LAYOUTS:
        for case in ("inner_wrong_shape", "rank1_inner_wrong_shape"):
            for rank, got in enumerate(run_distributed(load_case, kind, "ours", layout, case)):
                assert got["sharded_unchanged"], (layout, case, rank)
                assert got["error"] is not None and got["error"][0] == "StateDictLoadError", (layout, case, got)
                message = got["error"][1]
                assert f"on rank {rank} (nothing was loaded)" in message, message
                if case == "inner_wrong_shape" or rank == 1:
                    assert (f"size mismatch for {INNER}: copying a param with shape torch.Size([3, 5]) from "
                            f"checkpoint, the shape in current model is {SHAPE}.") in message, message
                else:
                    assert "failed on rank(s) [1]" in message and "size mismatch" not in message, message
        control = run_distributed(load_case, kind, "torch", layout, "rank1_inner_wrong_shape")
        assert control[0]["error"] is None and not control[0]["sharded_unchanged"], layout
        assert control[1]["error"] is not None, layout


@pytest.mark.parametrize("kind", ["classic", "fully_shard"])
def test_set_model_state_dict_through_a_plain_parent_changes_nothing_on_any_rank(kind: str) -> None:
    for layout in LAYOUTS:
        where = "Sequential" if layout == "sequential" else "Outer"
        before_key, after_key = _plain_keys(layout)
        for case in ("all_three", "rank1_wrong_shape"):
            for rank, got in enumerate(run_distributed(load_case, kind, "ours", layout, case, through="checkpoint")):
                assert got["unchanged"], (layout, case, rank)
                assert got["error"] is not None and got["error"][0] == "StateDictLoadError", (layout, case, got)
                message = got["error"][1]
                assert f"for {where} on rank {rank} (nothing was loaded)" in message, message
                if case == "all_three":
                    assert f'Missing key(s) in state_dict: "{before_key}".' in message, message
                    assert 'Unexpected key(s) in state_dict: "bogus.weight".' in message, message
                    assert (f"size mismatch for {_prefix(layout)}{INNER}: copying a param with shape "
                            f"torch.Size([3, 5]) from checkpoint, the shape in current model is {SHAPE}.") in message
                elif rank == 1:
                    assert (f"size mismatch for {after_key}: copying a param with shape torch.Size([2, 2]) from "
                            "checkpoint, the shape in current model is torch.Size([3, 4]).") in message, message
                else:
                    assert "failed on rank(s) [1]" in message and "size mismatch" not in message, message


@pytest.mark.parametrize("kind", ["classic", "fully_shard"])
def test_pytorch_half_loads_through_a_plain_parent(kind: str) -> None:
    """The reference that fails: the plain linear in front is copied before PyTorch raises; rank 1's damage
    leaves rank 0 loaded and rank 1 raising."""
    for layout in LAYOUTS:
        for rank, got in enumerate(run_distributed(load_case, kind, "torch", layout, "all_three")):
            assert got["error"] is not None and got["error"][0] == "RuntimeError" and not got["unchanged"], rank
        per_rank = run_distributed(load_case, kind, "torch", layout, "rank1_wrong_shape")
        assert per_rank[0]["error"] is None and per_rank[1]["error"] is not None
        assert not per_rank[0]["unchanged"] and not per_rank[1]["unchanged"]


@pytest.mark.parametrize("kind", ["classic", "fully_shard"])
def test_strict_false_through_a_plain_parent_loads_the_rest_as_pytorch_does(kind: str) -> None:
    """A missing and an unexpected key with strict=False: the rest loads, bitwise as PyTorch and the
    non-distributed run, and both keys are returned."""
    layout = "deep"
    reference = _plain(layout)
    state = _new_state(layout)
    _damage(state, "lenient", layout, 0)
    want_keys = reference.load_state_dict(state, strict=False)
    want = reference.state_dict()
    for impl in ("ours", "torch"):
        for got in run_distributed(load_case, kind, impl, layout, "lenient", False):
            assert got["error"] is None and got["keys"] == (want_keys.missing_keys, want_keys.unexpected_keys)
            for key, value in want.items():
                assert torch.equal(got["full"][key], value), (impl, key)
