"""Bad input to the averagers, the post-local SGD state and the averaging utils: clear errors, no processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
from tensorplay.distributed.algorithms.model_averaging import utils
from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from tensorplay.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
    validate_hierarchy,
)


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"period": 0}, ValueError, r"Arg ``period`` must be a positive value \(>= 1\), got 0"),
    ({"period": -3}, ValueError, r"Arg ``period`` must be a positive value \(>= 1\), got -3"),
    ({"period": 2.5}, TypeError, r"Arg ``period`` must be an int, got 2.5 \(float\)"),
    ({"period": 4, "warmup_steps": -1}, ValueError,
     r"Arg ``warmup_steps`` must be a non-negative number \(>= 0\), got -1"),
    ({"period": 4, "warmup_steps": "10"}, TypeError, r"Arg ``warmup_steps`` must be an int, got '10' \(str\)"),
])
def test_periodic_averager_rejects_bad_schedule(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        PeriodicModelAverager(**kwargs)


def test_hierarchical_averager_rejects_negative_warmup_before_touching_groups() -> None:
    with pytest.raises(ValueError, match=r"Arg ``warmup_steps`` must be a non-negative number"):
        HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=-2)


@pytest.mark.parametrize(("hierarchy", "overall", "pattern"), [
    (None, 8, r"must not be empty: pass \{period: group_size\}, e.g. \{4: 2, 16: 8\}"),
    ({}, 8, r"must not be empty"),
    ({0: 2, 4: 8}, 8, r"A period in arg ``period_group_size_dict`` must be a positive value \(>= 1\), got 0"),
    ({2: 0, 4: 8}, 8,
     r"The group size of period 2 in arg ``period_group_size_dict`` must be a positive value \(>= 1\), got 0"),
    ({2: 3, 4: 8}, 8, r"Group size 3 \(period 2\) .* must divide the size of arg ``process_group`` \(8\)"),
    ({8: 2, 4: 8}, 8, r"must be strictly increasing, got 4 after 8: order the entries by period"),
    ({2.5: 8}, 8, r"A period in arg ``period_group_size_dict`` must be an int, got 2.5 \(float\)"),
    ({2: 4, 4: 6, 8: 12}, 12, r"Group size 4 \(period 2\) must divide the next level's group size 6 \(period 4\)"),
    ({2: 2, 4: 4}, 8, r"last value in arg ``period_group_size_dict`` \(4\) must be equal to the size of arg "
                      r"``process_group`` \(8\)"),
])
def test_validate_hierarchy_names_the_problem(hierarchy: dict | None, overall: int, pattern: str) -> None:
    with pytest.raises((ValueError, TypeError), match=pattern):
        validate_hierarchy(hierarchy, overall)


def test_validate_hierarchy_accepts_nested_levels_in_order() -> None:
    assert validate_hierarchy({2: 2, 8: 4, 32: 16}, 16) == [(2, 2), (8, 4), (32, 16)]
    assert validate_hierarchy({5: 3}, 3) == [(5, 3)]


def test_post_local_sgd_state_rejects_negative_start() -> None:
    with pytest.raises(ValueError, match=r"start_localSGD_iter must be >= 0 .*got -1"):
        PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=-1)


def test_post_local_sgd_state_without_subgroup_needs_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(tp.accelerator, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"number of ranks per machine is unknown.*Pass subgroup="):
        PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10)
    # No gradient averaging after the switch: no subgroup needed.
    assert PostLocalSGDState(None, None, 10, post_local_gradient_allreduce=False).subgroup is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"one subgroup per machine of 0 ranks"):
        PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10)
    assert (state.iter, state.start_localSGD_iter, state.post_local_gradient_allreduce) == (0, 10, True)


def test_averaging_without_a_process_group_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=None))
    with pytest.raises(RuntimeError, match=r"call tensorplay.distributed.init_process_group\(\) first"):
        PeriodicModelAverager(period=4)


def test_params_to_average_keeps_those_with_gradients() -> None:
    with_grad, without_grad, plain = tp.nn.Parameter(tp.ones(2)), tp.nn.Parameter(tp.ones(3)), tp.ones(4)
    with_grad.grad, plain.grad = tp.zeros(2), tp.zeros(4)
    assert utils.get_params_to_average([with_grad, without_grad, plain]) == [with_grad, plain]
    groups = [{"params": [without_grad]}, {"params": [plain, with_grad], "lr": 0.1}]
    assert utils.get_params_to_average(groups) == [plain, with_grad]
    with pytest.raises(NotImplementedError, match=r"params\[1\] is a str; pass parameters .* or parameter groups"):
        utils.get_params_to_average([with_grad, "weight"])
