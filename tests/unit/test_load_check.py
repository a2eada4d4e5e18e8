"""The shared all-or-nothing load checker: every problem in one error, agreed across ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorplay.distributed._checks.load_check import (
    Expected,
    StateDictLoadError,
    agree_on_all_ranks,
    check_load,
    check_load_on_all_ranks,
    flatten_state,
    key_differences,
    load_problems,
)
from tensorplay.testing.distributed import run_distributed


def _expected() -> dict:
    return {"a.weight": torch.zeros(4, 3), "a.bias": (4,), "scale": None, "m": Expected((2,), torch.float64)}


def test_fitting_state_dict_passes() -> None:
    given = {"a.weight": torch.ones(4, 3), "a.bias": torch.ones(4), "scale": 2.0,
             "m": torch.zeros(2, dtype=torch.float64)}
    assert not load_problems(_expected(), given)
    check_load(_expected(), given, where="Thing")


def test_every_problem_is_listed_in_one_error() -> None:
    given = {"a.weight": torch.ones(3, 4), "a.bias": 7, "extra1": 1, "extra2": torch.ones(1),
             "m": torch.zeros(2, dtype=torch.float32)}
    with pytest.raises(StateDictLoadError) as info:
        check_load(_expected(), given, where="Thing")
    message = str(info.value)
    assert message.startswith("Error(s) in loading state_dict for Thing (nothing was loaded):")
    assert 'Missing key(s) in state_dict: "scale".' in message
    assert 'Unexpected key(s) in state_dict: "extra1", "extra2".' in message
    assert ("size mismatch for a.weight: copying a param with shape torch.Size([3, 4]) from checkpoint, the shape "
            "in current model is torch.Size([4, 3]).") in message
    assert "size mismatch for a.bias: copying a non-tensor value from checkpoint" in message
    assert "dtype mismatch for m: copying a param of dtype torch.float32" in message
    # Caught as what nn.Module (RuntimeError) and Optimizer (ValueError) raise.
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_non_strict_allows_missing_and_unexpected_but_not_wrong_shapes() -> None:
    given = {"a.weight": torch.ones(4, 3), "other": 1}
    assert not load_problems(_expected(), given, strict=False)
    problems = load_problems(_expected(), {"a.weight": torch.ones(1)}, strict=False)
    assert problems.wrong_shape == [("a.weight", (1,), (4, 3))] and not problems.missing
    assert key_differences(_expected(), given) == (["a.bias", "scale", "m"], ["other"])


def test_message_style_matches_nn_module() -> None:
    model = nn.Linear(3, 4)
    given = {"weight": torch.ones(3, 4), "bias2": torch.ones(4)}
    with pytest.raises(RuntimeError) as theirs:
        model.load_state_dict(given)
    with pytest.raises(StateDictLoadError) as ours:
        check_load(dict(model.state_dict()), given, where="Linear")
    for line in str(theirs.value).splitlines()[1:]:
        assert line.strip() in str(ours.value)


def test_flatten_state() -> None:
    t = torch.ones(2)
    assert flatten_state({"state": {0: {"m": t, "step": 3}}, "groups": []}) == {
        "state.0.m": t, "state.0.step": 3, "groups": []}


def test_agree_without_group_raises_the_local_error() -> None:
    agree_on_all_ranks(None, where="x")
    with pytest.raises(KeyError):
        agree_on_all_ranks(KeyError("k"), where="x")


def _agree_rank(bad_ranks: list[int]) -> str:
    import tensorplay.distributed as dist
    rank = dist.get_rank()
    given = {"w": torch.ones(2, 2) if rank in bad_ranks else torch.ones(2)}
    try:
        check_load_on_all_ranks({"w": (2,)}, given, where="Thing")
    except StateDictLoadError as error:
        return f"{error.failed_ranks}|{error}"
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_failure_on_one_rank_raises_on_every_rank(world_size: int) -> None:
    assert run_distributed(_agree_rank, [], world_size=world_size) == ["ok"] * world_size
    results = run_distributed(_agree_rank, [1], world_size=world_size)
    for rank, result in enumerate(results):
        failed, message = result.split("|", 1)
        assert failed == "[1]"
        assert f"for Thing on rank {rank} (nothing was loaded)" in message
        if rank == 1:
            assert "size mismatch for w" in message
        else:
            assert "The check also failed on rank(s) [1]" in message and "size mismatch" not in message
