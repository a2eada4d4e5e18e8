"""DDP over parameters that carry our in-backward optimizers == DDP + a plain optimizer, bitwise (2 ranks).

``apply_optimizer_in_backward`` gives each parameter its own optimizer; after wrapping,
``_register_optim_in_backward_hook(ddp)`` makes DDP step them on averaged gradients (see [Note: DDP and
optimizers in backward] in optimizer_overlap_hooks.py for why that call is explicit). Bitwise: DDP without a
hook halves then sums, the hook sums then halves, which is exact for a power-of-two world size; each
per-parameter optimizer runs the class optimizer's kernel on one tensor, as the plain one does on CPU.

With ``InBackwardOptions`` (accumulation over reduced micro-batches and under ``no_sync()``, exact and
previous-norm clipping) the same holds bitwise against the user's accumulation + ``clip_grad_norm_`` + step,
with several buckets and either gradient layout (the full optimizer table is in
``test_optim_in_backward_sharded.py``).

Without the call, PyTorch's DDP takes over at the first forward with PyTorch's hook, which fails at the end
of backward on CPU (it asks for the current accelerator stream): recorded here. PyTorch's own
``_apply_optimizer_in_backward`` with DDP fails the same way on CPU, so there is no PyTorch oracle to run.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
    _register_optim_in_backward_hook,
)
from tensorplay.distributed.optim import _apply_optimizer_in_backward
from tensorplay.distributed.optim.apply_optimizer_in_backward import InBackwardOptions
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_equal_tensors, error_of

STEPS = 3
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd_momentum": ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_amsgrad": ("AdamW", {"lr": 0.01, "amsgrad": True}),
}


def _model() -> tp.nn.Module:
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(6, 16), tp.nn.ReLU(), tp.nn.Linear(16, 8), tp.nn.ReLU(),
                            tp.nn.Linear(8, 2))


def _ddp(model: tp.nn.Module, bucket_view: bool) -> Any:
    # A tiny cap: several buckets, so steps happen bucket by bucket during backward.
    return tp.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005, gradient_as_bucket_view=bucket_view)


def _inputs() -> list[torch.Tensor]:
    gen = tp.Generator().manual_seed(100 + dist.get_rank())
    return [tp.randn(4, 6, generator=gen) for _ in range(STEPS)]


def _train(config: str, bucket_view: bool, in_backward: slice | None) -> dict[str, Any]:
    """``in_backward``: the parameters (by position) that get in-backward optimizers; the rest a plain one."""
    name, kwargs = CONFIGS[config]
    model = _model()
    params = list(model.parameters())
    stepped_in_backward = params[in_backward] if in_backward is not None else []
    if stepped_in_backward:
        _apply_optimizer_in_backward(getattr(tp.optim, name), stepped_in_backward, kwargs)
    rest = [p for p in params if all(p is not q for q in stepped_in_backward)]
    plain = getattr(tp.optim, name)(rest, **kwargs) if rest else None
    ddp = _ddp(model, bucket_view)
    if stepped_in_backward:
        _register_optim_in_backward_hook(ddp)
    grads_none = []
    for x in _inputs():
        ddp(x).square().mean().backward()
        grads_none.append([p.grad is None for p in stepped_in_backward])
        if plain is not None:
            plain.step()
            plain.zero_grad()
    return {"params": [p.detach().clone() for p in params], "grads_none": grads_none}


#: name: (options, micro-batches per step, the first ones under no_sync()); max_norm below the gradients' norm.
OPTION_CASES: dict[str, tuple[InBackwardOptions, int, bool]] = {
    "accum2_exact": (InBackwardOptions(accumulation_steps=2, max_norm=0.05, clip_mode="exact"), 2, False),
    "no_sync_previous": (InBackwardOptions(max_norm=0.05, clip_mode="previous"), 2, True),
}


def _train_with_options(case: str, bucket_view: bool, in_backward: bool) -> list[torch.Tensor]:
    """Adam on every parameter, in backward with the case's options or after backward as a user writes it."""
    options, micro_batches, no_sync = OPTION_CASES[case]
    model = _model()
    plain = None
    if in_backward:
        _apply_optimizer_in_backward(tp.optim.Adam, model.parameters(), {"lr": 0.01}, options=options)
    else:
        plain = tp.optim.Adam(model.parameters(), lr=0.01)
    ddp = _ddp(model, bucket_view)
    if in_backward:
        _register_optim_in_backward_hook(ddp)
    previous = None
    for x in _inputs():
        for micro in range(micro_batches):
            with ddp.no_sync() if no_sync and micro < micro_batches - 1 else contextlib.nullcontext():
                ddp(x * (micro + 1)).square().mean().backward()
        if plain is not None:
            previous = _clip_as_options(model, options, previous)
            plain.step()
            plain.zero_grad()
    assert not in_backward or all(p.grad is None for p in model.parameters()), "gradients kept"
    return [p.detach().clone() for p in model.parameters()]


def _clip_as_options(model: tp.nn.Module, options: InBackwardOptions, previous: Any) -> Any:
    """Exact: ``clip_grad_norm_``; previous: scale by the last step's coefficient (the first step exact)."""
    assert options.max_norm is not None
    norm = tp.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
    used = norm if options.clip_mode == "exact" or previous is None else previous
    coefficient = torch.clamp(options.max_norm / (used + 1e-6), max=1.0)
    assert coefficient < 1.0, "the case must clip"
    for param in model.parameters():
        param.grad.mul_(coefficient)
    return norm


def in_backward_runs() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for config in CONFIGS:
        for view in (False, True):
            results[f"{config}/{view}/plain"] = _train(config, view, None)
            results[f"{config}/{view}/all"] = _train(config, view, slice(None))
            results[f"{config}/{view}/first_layer"] = _train(config, view, slice(0, 2))
    for case in OPTION_CASES:
        for view in (False, True):
            results[f"{case}/{view}"] = {"ours": _train_with_options(case, view, True),
                                         "plain": _train_with_options(case, view, False)}
    results["errors"] = _error_cases()
    results["own_groups"] = error_of(_train_on_own_group)
    return results


def _train_on_own_group() -> None:
    """Each rank trains its own DDP over a one-rank group, accumulating a different number of micro-batches:
    valid (the trainings are apart), so the accumulation check must stay within DDP's group."""
    own = [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    model = _model()
    steps = 2 + dist.get_rank()
    _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1},
                                 options=InBackwardOptions(accumulation_steps=steps))
    ddp = tp.nn.parallel.DistributedDataParallel(model, process_group=own)
    _register_optim_in_backward_hook(ddp)
    for x in _inputs()[:1] * steps:
        ddp(x).sum().backward()
    assert all(p.grad is None for p in model.parameters()), "did not step"


def _error_cases() -> dict[str, Any]:
    model = _model()
    plain_ddp = _ddp(model, False)
    errors = {"not_ddp": error_of(_register_optim_in_backward_hook, model),
              "no_optimizers": error_of(_register_optim_in_backward_hook, plain_ddp)}
    model = _model()
    _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1})
    ddp = _ddp(model, False)
    _register_optim_in_backward_hook(ddp)
    errors["twice"] = error_of(_register_optim_in_backward_hook, ddp)
    # Without the explicit call: PyTorch's DDP registers PyTorch's hook, which fails on CPU. (DDP first reads
    # a handle map from PyTorch's optim package as an attribute of torch.distributed: without an earlier
    # import of that package it fails sooner, with AttributeError.)
    import torch.distributed.optim  # noqa: F401

    model = _model()
    _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1})
    ddp = _ddp(model, False)
    errors["without_the_call"] = error_of(lambda: ddp(_inputs()[0]).sum().backward())
    errors["after_forward"] = error_of(_register_optim_in_backward_hook, ddp)
    return errors


#: Both gradient layouts: ``.grad`` its own tensor, or a view of DDP's bucket.
BY_LAYOUT = pytest.mark.parametrize("view", [False, True], ids=["grad_copy", "grad_as_bucket_view"])


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_distributed(in_backward_runs, world_size=2)


@BY_LAYOUT
@pytest.mark.parametrize("config", list(CONFIGS))
def test_in_backward_optimizers_under_ddp_match_ddp_plus_step(per_rank: list[dict[str, Any]], config: str,
                                                               view: bool) -> None:
    start = [p.detach() for p in _model().parameters()]
    for rank, results in enumerate(per_rank):
        plain = results[f"{config}/{view}/plain"]["params"]
        assert any(not torch.equal(a, b) for a, b in zip(plain, start, strict=True)), "did not train"
        for variant in ("all", "first_layer"):
            run = results[f"{config}/{view}/{variant}"]
            assert_equal_tensors(run["params"], plain, f"rank {rank}, {config}, {variant}")
            assert all(all(step) for step in run["grads_none"]), "in-backward parameters keep .grad"
    assert_equal_tensors(per_rank[0][f"{config}/{view}/all"]["params"], per_rank[1][f"{config}/{view}/all"]["params"],
                         "ranks diverged")


@BY_LAYOUT
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_under_ddp_match_accumulation_clip_and_step(per_rank: list[dict[str, Any]], case: str,
                                                             view: bool) -> None:
    start = [p.detach() for p in _model().parameters()]
    for rank, results in enumerate(per_rank):
        run = results[f"{case}/{view}"]
        assert any(not torch.equal(a, b) for a, b in zip(run["plain"], start, strict=True)), "did not train"
        assert_equal_tensors(run["ours"], run["plain"], f"rank {rank}, {case}")


def test_errors(per_rank: list[dict[str, Any]]) -> None:
    errors = per_rank[0]["errors"]
    assert errors["not_ddp"][0] == "TypeError" and "must be a DistributedDataParallel, got Sequential" in \
        errors["not_ddp"][1]
    assert errors["no_optimizers"][0] == "ValueError" and "call apply_optimizer_in_backward" in \
        errors["no_optimizers"][1]
    for case in ("twice", "after_forward"):
        assert errors[case][0] == "ValueError" and "before the first forward" in errors[case][1], case
    assert errors["without_the_call"] is not None and "accelerator" in errors["without_the_call"][1]


def test_accumulation_check_stays_within_ddps_group(per_rank: list[dict[str, Any]]) -> None:
    assert [run["own_groups"] for run in per_rank] == [None, None]
