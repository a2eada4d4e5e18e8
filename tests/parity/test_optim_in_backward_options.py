"""``InBackwardOptions`` on one process: accumulation and clipping == a plain step, bitwise; bad input.

On a single process the global norm is summed as ``clip_grad_norm_`` sums it (the norm of the
per-parameter norms, in parameter order), so exact clipping is bitwise too. The multi-rank table is in
``test_optim_in_backward_sharded.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import tensorplay as tp
from tensorplay.distributed.optim import _FunctionalSGD
from tensorplay.distributed.optim.apply_optimizer_in_backward import InBackwardOptions, _apply_optimizer_in_backward

from tests.common import assert_equal_tensors

STEPS = 4


def _model() -> torch.nn.Module:
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(5, 12), tp.nn.Tanh(), tp.nn.Linear(12, 3))


def _loss(model: torch.nn.Module, step: int, micro: int) -> torch.Tensor:
    gen = tp.Generator().manual_seed(100 * step + micro)
    return model(tp.randn(4, 5, generator=gen)).square().mean() * 4.0


def _in_backward(options: InBackwardOptions, optim: Any = tp.optim.Adam,
                 kwargs: dict[str, Any] | None = None) -> list[torch.Tensor]:
    model = _model()
    _apply_optimizer_in_backward(optim, model.parameters(), kwargs or {"lr": 0.02}, options=options)
    for step in range(STEPS):
        for micro in range(options.accumulation_steps):
            _loss(model, step, micro).backward()
    assert all(p.grad is None for p in model.parameters()), "gradients kept after the stepping backward"
    return [p.detach().clone() for p in model.parameters()]


def _after_backward(options: InBackwardOptions, kwargs: dict[str, Any] | None = None) -> list[torch.Tensor]:
    model = _model()
    optimizer = tp.optim.Adam(model.parameters(), **(kwargs or {"lr": 0.02}))
    for step in range(STEPS):
        for micro in range(options.accumulation_steps):
            _loss(model, step, micro).backward()
        if options.max_norm is not None:
            tp.nn.utils.clip_grad_norm_(model.parameters(), options.max_norm, norm_type=options.norm_type)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options", [
    InBackwardOptions(),
    InBackwardOptions(accumulation_steps=3),
    InBackwardOptions(max_norm=0.2, clip_mode="exact"),
    InBackwardOptions(max_norm=0.2, clip_mode="exact", norm_type=math.inf),
    InBackwardOptions(max_norm=0.2, clip_mode="exact", norm_type=1.0),
    InBackwardOptions(accumulation_steps=2, max_norm=0.2, clip_mode="exact"),
], ids=["step", "accum3", "exact", "exact_inf", "exact_l1", "accum2_exact"])
def test_matches_plain_step_bitwise(options: InBackwardOptions) -> None:
    want = _after_backward(options)
    assert any(not torch.equal(a, b) for a, b in zip(want, _model().parameters(), strict=True))
    assert_equal_tensors(_in_backward(options), want, str(options))


def test_previous_norm_first_step_exact_then_previous_coefficient() -> None:
    """Previous-norm == scaling each step's gradients by the coefficient of the step before (first: exact)."""
    options = InBackwardOptions(max_norm=0.2, clip_mode="previous")
    model = _model()
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    previous = None
    for step in range(STEPS):
        _loss(model, step, 0).backward()
        norm = tp.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        coefficient = torch.clamp(0.2 / ((previous if previous is not None else norm) + 1e-6), max=1.0)
        for p in model.parameters():
            p.grad.mul_(coefficient)
        previous = norm
        optimizer.step()
        optimizer.zero_grad()
    got = _in_backward(options, tp.optim.SGD, {"lr": 0.1})
    assert_equal_tensors(got, [p.detach() for p in model.parameters()], "previous")


def test_functional_optimizer_steps_in_backward() -> None:
    got = _in_backward(InBackwardOptions(max_norm=0.2, clip_mode="exact"), _FunctionalSGD, {"lr": 0.1})
    model = _model()
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        _loss(model, step, 0).backward()
        tp.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        optimizer.step()
        optimizer.zero_grad()
    assert_equal_tensors(got, [p.detach() for p in model.parameters()], "functional")


# ---- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "kind", "words"), [
    ({"max_norm": 1.0}, ValueError, "max_norm=1.0 needs clip_mode: 'exact'"),
    ({"clip_mode": "exact"}, ValueError, "clip_mode='exact' needs max_norm"),
    ({"max_norm": 1.0, "clip_mode": "approx"}, ValueError, "clip_mode must be one of ('exact', 'previous')"),
    ({"accumulation_steps": 0}, ValueError, "accumulation_steps must be >= 1"),
    ({"accumulation_steps": 1.5}, TypeError, "accumulation_steps must be an int"),
    ({"max_norm": -1.0, "clip_mode": "exact"}, ValueError, "max_norm must be > 0.0"),
])
def test_options_rejected(kwargs: dict[str, Any], kind: type, words: str) -> None:
    with pytest.raises(kind) as caught:
        InBackwardOptions(**kwargs)
    assert words in str(caught.value) and "InBackwardOptions" in str(caught.value)


def test_options_must_be_in_backward_options() -> None:
    with pytest.raises(TypeError, match="options must be"):
        _apply_optimizer_in_backward(tp.optim.SGD, _model().parameters(), {"lr": 0.1},
                                     options={"max_norm": 1.0})  # type: ignore[arg-type]


def test_plain_optimizer_over_in_backward_parameter_raises_naming_it() -> None:
    model = _model()
    _apply_optimizer_in_backward(tp.optim.SGD, list(model.parameters())[2:], {"lr": 0.1})
    plain = tp.optim.SGD(model.parameters(), lr=0.1)
    _loss(model, 0, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"SGD.step\(\): param_groups\[0\]\['params'\]\[2\] \(shape \[3, 12\]\) "
                                         r"has optimizers applied in backward"):
        plain.step()
    assert_equal_tensors([p.detach() for p in model.parameters()], before, "a refused step touched a parameter")
    tp.optim.SGD(list(model.parameters())[:2], lr=0.1).step()  # the others: fine


def test_direct_step_of_an_optimizer_with_options_raises() -> None:
    model = _model()
    _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1},
                                 options=InBackwardOptions(max_norm=1.0, clip_mode="exact"))
    optimizer = next(iter(model.parameters()))._in_backward_optimizers[0]  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="stepped by backward"):
        optimizer.step()


def test_parameter_in_two_calls_with_options_raises() -> None:
    model = _model()
    params = list(model.parameters())
    _apply_optimizer_in_backward(tp.optim.SGD, params[:2], {"lr": 0.1})
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \[12\]\) already has in-backward optimizers"):
        _apply_optimizer_in_backward(tp.optim.SGD, params[1:], {"lr": 0.1},
                                     options=InBackwardOptions(accumulation_steps=2))
    assert not hasattr(params[2], "_in_backward_optimizers"), "a rejected call attached an optimizer"
