"""Model averaging on 4 ranks: the flat-buffer utils and the hierarchical averager vs PyTorch's."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hierarchical
import torch.distributed.algorithms.model_averaging.utils as torch_utils

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.model_averaging import averagers, hierarchical_model_averager, utils
from tensorplay.testing.distributed import run_distributed

from tests.common import SyncAllReduceLog, error_of

WORLD = 4
STEPS = 9
HIERARCHIES = [({2: 2, 4: 4}, 1), ({3: 2, 6: 4}, 2)]  # (period_group_size_dict, warmup_steps)


def _mixed_params() -> list[tp.nn.Parameter]:
    """Per-rank values in fp32, fp64 and bf16; the third has no gradient."""
    gen = tp.Generator().manual_seed(10 + dist.get_rank())
    params = [tp.nn.Parameter(tp.randn(3, 2, generator=gen)),
              tp.nn.Parameter(tp.randn(4, generator=gen, dtype=tp.float64)),
              tp.nn.Parameter(tp.randn(5, generator=gen)),
              tp.nn.Parameter(tp.randn(3, generator=gen).to(tp.bfloat16))]
    for index in (0, 1, 3):
        params[index].grad = tp.zeros_like(params[index])
    return params


def _clone(params: list[tp.nn.Parameter]) -> list[tp.nn.Parameter]:
    return [p.detach().clone() for p in params]


# case: (as param groups?, over the first three ranks only?, indices of the _mixed_params passed)
UTILS_CASES = {
    "all_world": (False, False, [0, 1, 2, 3]),
    "groups_world": (True, False, [0, 1, 2, 3]),
    "groups_first_three": (True, True, [0, 1, 2, 3]),  # divides by 3: not exact, unlike 4
    "fp32_first_three": (False, True, [0, 2]),  # one dtype: packed without promotion
}


def _utils_case(as_groups: bool, group: dist.ProcessGroup | None, keep: list[int]) -> dict[str, Any]:
    mine, reference = ([_mixed_params()[i] for i in keep] for _ in range(2))
    before = _clone(mine)
    pointers = [p.data_ptr() for p in mine]
    with SyncAllReduceLog() as log:
        if as_groups:
            utils.average_parameters_or_parameter_groups([{"params": mine[:2]}, {"params": mine[2:]}], group)
            torch_utils.average_parameters_or_parameter_groups(
                [{"params": reference[:2]}, {"params": reference[2:]}], group)
        else:
            utils.average_parameters(iter(mine), group)
            torch_utils.average_parameters(iter(reference), group)
    return {"ours": _clone(mine), "theirs": _clone(reference), "before": before, "calls": log.calls,
            "in_place": pointers == [p.data_ptr() for p in mine]}


def _utils_runs() -> dict[str, Any]:
    first_three = dist.new_group([0, 1, 2])
    return {name: _utils_case(as_groups, first_three if three else None, keep)
            for name, (as_groups, three, keep) in UTILS_CASES.items()}


def _hierarchical_run(make_averager: Callable[[], Any]) -> torch.Tensor:
    tp.manual_seed(0)
    model = tp.nn.Sequential(tp.nn.Linear(3, 4), tp.nn.Tanh(), tp.nn.Linear(4, 1))
    opt = tp.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    averager = make_averager()
    gen = tp.Generator().manual_seed(200 + dist.get_rank())
    after = []
    for _ in range(STEPS):
        opt.zero_grad()
        model(tp.randn(2, 3, generator=gen)).square().mean().backward()
        opt.step()
        averager.average_parameters(opt.param_groups)
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return torch.stack(after)


def _error(make: Callable[[], Any]) -> tuple[str, str] | None:
    return error_of(make, catch=(ValueError, TypeError))


def _warnings_of(make: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


BAD_HIERARCHIES = {
    "size_not_dividing_world": {2: 3, 4: 4},
    "last_not_world": {2: 2, 4: 2},
    "periods_not_increasing": {4: 2, 2: 4},
    "empty": {},
}


def _validation_runs() -> dict[str, Any]:
    ours = {name: _error(lambda d=d: hierarchical_model_averager.HierarchicalModelAverager(d))
            for name, d in BAD_HIERARCHIES.items()}
    theirs = {name: _error(lambda d=d: torch_hierarchical.HierarchicalModelAverager(d))
              for name, d in BAD_HIERARCHIES.items()}
    ours["negative_warmup"] = _error(lambda: hierarchical_model_averager.HierarchicalModelAverager({2: 4}, -1))
    theirs["negative_warmup"] = _error(lambda: torch_hierarchical.HierarchicalModelAverager({2: 4}, -1))
    warned = {
        "periodic": _warnings_of(lambda: averagers.PeriodicModelAverager(1)),
        "hierarchical": _warnings_of(lambda: hierarchical_model_averager.HierarchicalModelAverager({1: 4})),
    }
    return {"ours": ours, "theirs": theirs, "warned": warned}


def model_averaging_runs() -> dict[str, Any]:
    results: dict[str, Any] = {"utils": _utils_runs(), "validation": _validation_runs()}
    for index, (hierarchy, warmup) in enumerate(HIERARCHIES):
        results["hierarchical", index] = (
            _hierarchical_run(
                functools.partial(hierarchical_model_averager.HierarchicalModelAverager, hierarchy, warmup)),
            _hierarchical_run(functools.partial(torch_hierarchical.HierarchicalModelAverager, hierarchy, warmup)),
        )
    results["periodic"] = (_hierarchical_run(lambda: averagers.PeriodicModelAverager(3, 2)),
                           _hierarchical_run(lambda: torch_averagers.PeriodicModelAverager(3, 2)))
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(model_averaging_runs, world_size=WORLD)


@pytest.mark.parametrize("case", list(UTILS_CASES))
def test_average_parameters_matches_pytorch(runs: list[dict[str, Any]], case: str) -> None:
    as_groups, three, keep = UTILS_CASES[case]
    members = [0, 1, 2] if three else list(range(WORLD))
    numels = {0: 6, 1: 4, 2: 5, 3: 3}
    averaged = [i for i in keep if not (as_groups and i == 2)]  # the param without a grad is left out in groups
    for rank, result in enumerate(runs):
        r = result["utils"][case]
        assert all(torch.equal(a, b) for a, b in zip(r["ours"], r["theirs"], strict=True)), rank
        assert all(a.dtype == b.dtype for a, b in zip(r["ours"], r["before"], strict=True)), rank
        assert r["in_place"], rank
        # One all-reduce of one flat buffer (ours only: PyTorch's runs outside the log's reach).
        assert r["calls"] == [sum(numels[i] for i in averaged)] * (rank in members), rank
        for now, before, index in zip(r["ours"], r["before"], keep, strict=True):
            changed = rank in members and index in averaged
            assert torch.equal(now, before) != changed, (rank, index)
    for index in range(4):
        stacked = torch.stack([result["utils"]["all_world"]["before"][index].double() for result in runs])
        torch.testing.assert_close(runs[0]["utils"]["all_world"]["ours"][index].double(), stacked.mean(0),
                                   rtol=1e-2 if index == 3 else 1e-6, atol=1e-6)  # bf16: 8 bits


@pytest.mark.parametrize("index", range(len(HIERARCHIES)))
def test_hierarchical_matches_pytorch_and_averages_on_schedule(runs: list[dict[str, Any]], index: int) -> None:
    hierarchy, warmup = HIERARCHIES[index]
    (short_period, _), (long_period, _) = hierarchy.items()
    for rank, result in enumerate(runs):
        ours, theirs = result["hierarchical", index]
        assert torch.equal(ours, theirs), rank
    for step in range(STEPS):
        at = [r["hierarchical", index][0][step] for r in runs]
        global_step = step >= warmup and step % long_period == 0
        pair_step = global_step or (step >= warmup and step % short_period == 0)
        assert torch.equal(at[0], at[1]) == pair_step and torch.equal(at[2], at[3]) == pair_step, step
        assert torch.equal(at[0], at[2]) == global_step, step


def test_periodic_averager_matches_pytorch(runs: list[dict[str, Any]]) -> None:
    for result in runs:
        ours, theirs = result["periodic"]
        assert torch.equal(ours, theirs)
    at_step = [[r["periodic"][0][step] for r in runs] for step in range(STEPS)]
    assert [all(torch.equal(a[0], x) for x in a) for a in at_step] == [s in (2, 5, 8) for s in range(STEPS)]


def test_bad_hierarchies_fail_at_construction(runs: list[dict[str, Any]]) -> None:
    expected = {
        "size_not_dividing_world": r"Group size 3 \(period 2\) in arg ``period_group_size_dict`` must divide "
                                   r"the size of arg ``process_group`` \(4\)",
        "last_not_world": r"last value in arg ``period_group_size_dict`` \(2\) must be equal to the size of arg "
                          r"``process_group`` \(4\)",
        "periods_not_increasing": r"periods in arg ``period_group_size_dict`` must be strictly increasing, "
                                  r"got 2 after 4",
        "empty": r"``period_group_size_dict`` must not be empty",
        "negative_warmup": r"Arg ``warmup_steps`` must be a non-negative number \(>= 0\), got -1",
    }
    for result in runs:
        ours, theirs = result["validation"]["ours"], result["validation"]["theirs"]
        for name, pattern in expected.items():
            assert ours[name] is not None and ours[name][0] == "ValueError", name
            assert re.search(pattern, ours[name][1]), (name, ours[name])
            # Where PyTorch also refuses, it raises the same type; it accepts unordered periods.
            assert theirs[name] is None if name == "periods_not_increasing" else theirs[name][0] == "ValueError"
        warned = result["validation"]["warned"]
        assert len(warned["periodic"]) == 1 and "period is 1" in warned["periodic"][0]
        assert len(warned["hierarchical"]) == 1 and "largest period" in warned["hierarchical"][0]
