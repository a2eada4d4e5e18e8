"""apply_optimizer_in_backward: the same parameters as backward() + step(), grads freed in backward.

Oracle: a plain ``loss.backward(); optim.step()`` loop with one optimizer per
parameter (what in-backward stepping is), and PyTorch's own
``_apply_optimizer_in_backward``. Bitwise: the per-parameter updates are the
same kernels in the same order.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.optim import _apply_optimizer_in_backward as torch_apply_in_backward

import tensorplay as tp
from tensorplay.distributed.optim.apply_optimizer_in_backward import (
    _apply_optimizer_in_backward,
    _get_in_backward_optimizers,
    apply_optimizer_in_backward,
)

STEPS = 3


class TwoTowers(tp.nn.Module):
    """Two branches sharing one embedding-like weight (a tied parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.left = tp.nn.Linear(4, 3)
        self.right = tp.nn.Linear(4, 3)
        self.right.weight = self.left.weight  # shared: one tensor in two modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.left(x) * self.right(x.flip(-1))).sum()


def _model(seed: int = 0) -> tp.nn.Module:
    torch.manual_seed(seed)
    return tp.nn.Sequential(tp.nn.Linear(4, 8), tp.nn.Tanh(), tp.nn.Linear(8, 2))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(5, 4, generator=gen) for _ in range(STEPS)]


def _reference(model: tp.nn.Module, optim_cls: type, kwargs: dict, loss_fn=None) -> list[torch.Tensor]:
    optims = [optim_cls([p], **kwargs) for p in model.parameters()]
    for x in _batches():
        (loss_fn or (lambda m, x: m(x).pow(2).sum()))(model, x).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _in_backward(model: tp.nn.Module, apply, optim_cls: type, kwargs: dict, loss_fn=None) -> list[torch.Tensor]:
    apply(optim_cls, model.parameters(), kwargs)
    for x in _batches():
        (loss_fn or (lambda m, x: m(x).pow(2).sum()))(model, x).backward()
        assert all(p.grad is None for p in model.parameters()), "grads must be freed inside backward"
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(expected: list[torch.Tensor], actual: list[torch.Tensor], what: str) -> None:
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(e, a), f"{what}: parameter {i} differs by {(e - a).abs().max().item():.3g}"


@pytest.mark.parametrize(("optim_cls", "kwargs"), [
    (tp.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (tp.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}),
    (tp.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    (tp.optim.RMSprop, {"lr": 0.01, "centered": True}),
], ids=["sgd", "adam", "adamw", "rmsprop"])
def test_matches_backward_then_step_and_pytorch(optim_cls: type, kwargs: dict) -> None:
    expected = _reference(_model(), optim_cls, kwargs)
    _assert_equal(expected, _in_backward(_model(), apply_optimizer_in_backward, optim_cls, kwargs), "ours")
    _assert_equal(expected, _in_backward(_model(), torch_apply_in_backward, optim_cls, kwargs), "PyTorch's")


def test_private_name_is_the_public_one() -> None:
    assert _apply_optimizer_in_backward is apply_optimizer_in_backward


def _tied_weight_runs(apply) -> list[torch.Tensor]:
    """A weight tied between two towers, each tower's parameters passed in its own call."""
    torch.manual_seed(0)
    model = TwoTowers()
    apply(tp.optim.SGD, model.left.parameters(), {"lr": 0.1})
    apply(tp.optim.SGD, model.right.parameters(), {"lr": 0.1})
    for x in _batches():
        model(x).backward()
        assert all(p.grad is None for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()]


def test_parameter_reached_through_two_modules_steps_per_listing() -> None:
    """Two calls naming a tied weight attach two optimizers: it steps twice per backward, as two class
    optimizers over the two towers' parameters would, and as PyTorch's in-backward optimizers do."""
    torch.manual_seed(0)
    reference = TwoTowers()
    optims = [tp.optim.SGD(reference.left.parameters(), lr=0.1), tp.optim.SGD(reference.right.parameters(), lr=0.1)]
    for x in _batches():
        reference(x).backward()
        for optim in optims:
            optim.step()
        reference.zero_grad(set_to_none=True)
    expected = [p.detach() for p in reference.parameters()]
    _assert_equal(expected, _tied_weight_runs(apply_optimizer_in_backward), "ours")
    _assert_equal(expected, _tied_weight_runs(torch_apply_in_backward), "PyTorch's")


def test_tied_weight_through_model_parameters_steps_once() -> None:
    """``model.parameters()`` lists a tied weight once: one optimizer, one step per backward."""
    kwargs = {"lr": 0.1}

    def loss(m, x):
        return m(x)

    torch.manual_seed(0)
    expected = _reference(TwoTowers(), tp.optim.SGD, kwargs, loss)
    torch.manual_seed(0)
    model = TwoTowers()
    apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), kwargs)
    assert len(model.left.weight._in_backward_optimizers) == 1
    for x in _batches():
        loss(model, x).backward()
    _assert_equal(expected, [p.detach() for p in model.parameters()], "tied weight")


def test_parameter_listed_twice_in_one_call_steps_twice_with_warning() -> None:
    """As ``SGD([w, w])`` (which warns and updates ``w`` twice) and PyTorch's in-backward optimizers."""
    results = {}
    for name, apply in (("ours", apply_optimizer_in_backward), ("torch", torch_apply_in_backward),
                        ("class", None)):
        weight = tp.nn.Parameter(torch.ones(3))
        if name == "ours":
            with pytest.warns(UserWarning, match="optimizer contains a parameter group with duplicate parameters"):
                apply(tp.optim.SGD, [weight, weight], {"lr": 0.5})
            assert len(weight._in_backward_optimizers) == 2
        elif apply is not None:
            apply(tp.optim.SGD, [weight, weight], {"lr": 0.5})
        else:
            with pytest.warns(UserWarning, match="optimizer contains a parameter group with duplicate parameters"):
                optim = tp.optim.SGD([weight, weight], lr=0.5)
        for _ in range(2):
            (weight * torch.arange(3.0)).sum().backward()
            if apply is None:
                optim.step()
                optim.zero_grad()
            assert weight.grad is None
        results[name] = weight.detach()
    assert torch.equal(results["class"], torch.tensor([1.0, -1.0, -3.0]))
    assert torch.equal(results["ours"], results["class"]) and torch.equal(results["torch"], results["class"])


def test_two_optimizer_classes_on_one_parameter_both_step() -> None:
    torch.manual_seed(0)
    reference, ours = _model(), _model()
    sgd_ref = [tp.optim.SGD([p], lr=0.1) for p in reference.parameters()]
    adam_ref = [tp.optim.Adam([p], lr=0.01) for p in reference.parameters()]
    apply_optimizer_in_backward(tp.optim.SGD, ours.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(tp.optim.Adam, ours.parameters(), {"lr": 0.01})
    for x in _batches():
        reference(x).pow(2).sum().backward()
        for sgd, adam in zip(sgd_ref, adam_ref, strict=True):
            sgd.step()
            adam.step()
            sgd.zero_grad(set_to_none=True)
        ours(x).pow(2).sum().backward()
    _assert_equal([p.detach() for p in reference.parameters()], [p.detach() for p in ours.parameters()], "sgd+adam")


def test_no_accumulation_across_backward_calls() -> None:
    """Two backward passes per batch step twice, each on its own gradient: nothing accumulates."""
    kwargs = {"lr": 0.05, "momentum": 0.9}
    torch.manual_seed(0)
    reference, ours = _model(), _model()
    optims = [tp.optim.SGD([p], **kwargs) for p in reference.parameters()]
    apply_optimizer_in_backward(tp.optim.SGD, ours.parameters(), kwargs)
    for x in _batches():
        for half in (x[:2], x[2:]):
            reference(half).pow(2).sum().backward()
            for optim in optims:
                optim.step()
                optim.zero_grad(set_to_none=True)
            ours(half).pow(2).sum().backward()
    _assert_equal([p.detach() for p in reference.parameters()], [p.detach() for p in ours.parameters()], "micro")


def test_get_in_backward_optimizers_round_trip_state() -> None:
    model = _model()
    apply_optimizer_in_backward(tp.optim.Adam, model.parameters(), {"lr": 0.01})
    model(_batches()[0]).sum().backward()
    optims = _get_in_backward_optimizers(model)
    assert len(optims) == len(list(model.parameters()))
    assert all(isinstance(o, tp.optim.Adam) for o in optims)
    state = optims[0].state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].item() == 1.0
    assert model[0].weight._optimizer_classes == [tp.optim.Adam]
    assert model[0].weight._optimizer_kwargs == [{"lr": 0.01}]


def test_register_hook_false_only_attaches() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1}, register_hook=False)
    model(_batches()[0]).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    _assert_equal(before, [p.detach() for p in model.parameters()], "unchanged")
    assert len(_get_in_backward_optimizers(model)) == len(before)


def test_non_leaf_parameter_named_by_index() -> None:
    weight = tp.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"params\[1\] is not a leaf tensor"):
        apply_optimizer_in_backward(tp.optim.SGD, [weight, weight * 2], {"lr": 0.1})


def test_parameter_without_grad_named_by_index() -> None:
    with pytest.raises(ValueError, match=r"params\[0\] does not require grad"):
        apply_optimizer_in_backward(tp.optim.SGD, [torch.ones(2)], {"lr": 0.1})
