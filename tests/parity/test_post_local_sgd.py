"""Post-local SGD on 4 ranks (pairs as subgroups), ours vs PyTorch's, bitwise on fp32.

The full stack: DDP + post_localSGD_hook + PostLocalSGDOptimizer(SGD, PeriodicModelAverager),
each rank on its own data. Also the state_dict round trip.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as torch_hook
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.optim as torch_optim

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as our_hook
import tensorplay.distributed.algorithms.model_averaging.averagers as our_averagers
from tensorplay.distributed.optim.post_localSGD_optimizer import PostLocalSGDOptimizer
from tensorplay.testing.distributed import run_distributed

from tests.common import SyncAllReduceLog

WORLD = 4
WARMUP = 2
PERIOD = 3
STEPS = 9
AVERAGING_STEPS = [s for s in range(STEPS) if s >= WARMUP and (s - WARMUP) % PERIOD == 0]  # 2, 5, 8


@dataclass(frozen=True)
class Impl:
    state: type
    hook: Any
    averager: type
    optimizer: type


OURS = Impl(our_hook.PostLocalSGDState, our_hook.post_localSGD_hook, our_averagers.PeriodicModelAverager,
            PostLocalSGDOptimizer)
THEIRS = Impl(torch_hook.PostLocalSGDState, torch_hook.post_localSGD_hook, torch_averagers.PeriodicModelAverager,
              torch_optim.PostLocalSGDOptimizer)


def _model() -> tp.nn.Module:
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(4, 3), tp.nn.Tanh(), tp.nn.Linear(3, 2))


def _flat(model: tp.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _batches(steps: int) -> list[torch.Tensor]:
    gen = tp.Generator().manual_seed(100 + dist.get_rank())
    return [tp.randn(3, 4, generator=gen) for _ in range(steps)]


def _ddp_run(impl: Impl, pairs: dist.ProcessGroup | None, gradient_allreduce: bool) -> dict[str, Any]:
    model = _model()
    ddp = tp.nn.parallel.DistributedDataParallel(model)
    state = impl.state(process_group=None, subgroup=pairs, start_localSGD_iter=WARMUP,
                       post_local_gradient_allreduce=gradient_allreduce)
    ddp.register_comm_hook(state, impl.hook)
    local = tp.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    local_values: list[torch.Tensor] = []
    local.register_step_post_hook(lambda *_: local_values.append(_flat(model)))  # before averaging
    opt = impl.optimizer(local, impl.averager(period=PERIOD, warmup_steps=WARMUP))
    after: list[torch.Tensor] = []
    averaging_calls: list[list[int]] = []
    for batch in _batches(STEPS):
        opt.zero_grad()
        ddp(batch).square().mean().backward()
        with SyncAllReduceLog() as log:
            opt.step()
        averaging_calls.append(log.calls)
        after.append(_flat(model))
    return {"local": torch.stack(local_values), "after": torch.stack(after), "calls": averaging_calls,
            "averager_step": opt.state_dict()["step"], "hook_iter": state.iter}


def _local_run(impl: Impl, steps: range, batches: list[torch.Tensor], model: tp.nn.Module,
               opt: Any) -> None:
    for s in steps:
        opt.zero_grad()
        model(batches[s]).square().mean().backward()
        opt.step()


def _local_opt(impl: Impl, model: tp.nn.Module) -> Any:
    local = tp.optim.Adam(model.parameters(), lr=0.05)
    return impl.optimizer(local, impl.averager(period=PERIOD, warmup_steps=WARMUP))


def _resume(impl: Impl) -> dict[str, Any]:
    """Uninterrupted 9 steps vs 5 steps, state_dict, a fresh optimizer that loads it, 4 more steps."""
    batches = _batches(STEPS)
    whole = _model()
    _local_run(impl, range(STEPS), batches, whole, _local_opt(impl, whole))
    first = _model()
    opt = _local_opt(impl, first)
    _local_run(impl, range(5), batches, first, opt)
    saved = opt.state_dict()
    resumed = _model()
    resumed.load_state_dict(first.state_dict())
    opt2 = _local_opt(impl, resumed)
    opt2.load_state_dict(saved)
    step_after_load = opt2.averager.step
    _local_run(impl, range(5, STEPS), batches, resumed, opt2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(opt2.optim.state_dict())  # the bare local optimizer's: no "step"
    return {"whole": _flat(whole), "resumed": _flat(resumed), "saved_step": saved["step"],
            "step_after_load": step_after_load, "step_after_bad_load": opt2.averager.step,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
            "saved_keys": sorted(saved)}


def post_local_sgd_runs() -> dict[str, Any]:
    pairs, _ = dist.new_subgroups(group_size=2)
    results: dict[str, Any] = {}
    for name, impl in (("ours", OURS), ("theirs", THEIRS)):
        for gradient_allreduce in (True, False):
            results[name, gradient_allreduce] = _ddp_run(impl, pairs, gradient_allreduce)
        results[name, "resume"] = _resume(impl)
    # subgroup=None: one subgroup per machine, sized by LOCAL_WORLD_SIZE (PyTorch's needs CUDA for this).
    local_world_size = os.environ["LOCAL_WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        results["ours", "per_machine"] = _ddp_run(OURS, None, True)
        os.environ["LOCAL_WORLD_SIZE"] = "3"
        try:
            our_hook.PostLocalSGDState(None, None, start_localSGD_iter=WARMUP)
        except ValueError as error:
            results["ours", "bad_machine_size"] = str(error)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = local_world_size
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(post_local_sgd_runs, world_size=WORLD)


@pytest.mark.parametrize("gradient_allreduce", [True, False])
def test_matches_pytorch_bitwise(runs: list[dict[str, Any]], gradient_allreduce: bool) -> None:
    for rank, result in enumerate(runs):
        ours, theirs = result["ours", gradient_allreduce], result["theirs", gradient_allreduce]
        assert torch.equal(ours["local"], theirs["local"]), rank
        assert torch.equal(ours["after"], theirs["after"]), rank
        assert ours["averager_step"] == theirs["averager_step"] == STEPS
        assert ours["hook_iter"] == theirs["hook_iter"] == WARMUP


def test_default_subgroup_is_one_per_machine(runs: list[dict[str, Any]]) -> None:
    for result in runs:
        assert torch.equal(result["ours", "per_machine"]["after"], result["ours", True]["after"])
        assert "one subgroup per machine of 3 ranks, which does not divide the world size 4: pass subgroup=" \
            in result["ours", "bad_machine_size"]


def _equal_on(runs: list[dict[str, Any]], key: Any, step: int, a: int, b: int) -> bool:
    return torch.equal(runs[a][key]["after"][step], runs[b][key]["after"][step])


@pytest.mark.parametrize("gradient_allreduce", [True, False])
def test_identical_exactly_at_averaging_steps(runs: list[dict[str, Any]], gradient_allreduce: bool) -> None:
    key = ("ours", gradient_allreduce)
    for step in range(STEPS):
        all_equal = all(_equal_on(runs, key, step, 0, r) for r in range(1, WORLD))
        # Warm-up: DDP averages the gradients globally, so the replicas never diverge.
        assert all_equal == (step < WARMUP or step in AVERAGING_STEPS), step
        if step >= WARMUP and step not in AVERAGING_STEPS:
            # Pairs still share gradients when post_local_gradient_allreduce is on.
            assert _equal_on(runs, key, step, 0, 1) == gradient_allreduce, step
            assert _equal_on(runs, key, step, 2, 3) == gradient_allreduce, step


@pytest.mark.parametrize("gradient_allreduce", [True, False])
def test_averaged_value_is_mean_of_local_values(runs: list[dict[str, Any]], gradient_allreduce: bool) -> None:
    key = ("ours", gradient_allreduce)
    local = torch.stack([r[key]["local"] for r in runs])  # [rank, step, numel]
    for step in AVERAGING_STEPS:
        assert not torch.equal(local[0, step], local[2, step])  # there was something to average
        torch.testing.assert_close(runs[0][key]["after"][step], local[:, step].mean(0), rtol=1e-6, atol=1e-7)
    numel = local.shape[-1]
    for result in runs:
        # One flat all-reduce of every parameter, only at the averaging steps.
        assert result[key]["calls"] == [[numel] if s in AVERAGING_STEPS else [] for s in range(STEPS)]


def test_state_dict_round_trip_resumes_step_count(runs: list[dict[str, Any]]) -> None:
    for result in runs:
        ours, theirs = result["ours", "resume"], result["theirs", "resume"]
        assert torch.equal(ours["resumed"], ours["whole"])
        assert torch.equal(ours["whole"], theirs["whole"])
        assert ours["saved_step"] == ours["step_after_load"] == 5
        assert ours["saved_keys"] == theirs["saved_keys"] == ["param_groups", "state", "step"]
        assert ours["step_after_bad_load"] == 0
        assert len(ours["warnings"]) == 1 and "does not contain a step counter" in ours["warnings"][0]
    # Different data per rank, averaged at the last step: every rank ends equal.
    assert all(torch.equal(runs[0]["ours", "resume"]["whole"], r["ours", "resume"]["whole"]) for r in runs)
