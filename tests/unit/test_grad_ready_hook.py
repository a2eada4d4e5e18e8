"""The "gradient ready" hook point (``_sharding/grad_ready.py``) and ``apply_optimizer_in_backward`` being one
object that is both PyTorch's module and the seeds' function."""

from __future__ import annotations

import inspect
import types

import torch

import tensorplay as tp
import tensorplay.distributed.optim as optim
import tensorplay.distributed.optim.apply_optimizer_in_backward as in_backward_module
from tensorplay.distributed._sharding.grad_ready import grad_ready, has_grad_ready_hook, register_grad_ready_hook


def test_hooks_live_on_their_parameter_and_run_once_each_in_order():
    first, second, other = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    seen: list[tuple[str, tuple[object, ...], tuple[object, ...]]] = []

    def a(param: torch.Tensor, groups: tuple[object, ...], ranks: tuple[object, ...]) -> None:
        seen.append(("a", groups, ranks))

    def b(param: torch.Tensor, groups: tuple[object, ...], ranks: tuple[object, ...]) -> None:
        seen.append(("b", groups, ranks))

    register_grad_ready_hook(first, a)
    register_grad_ready_hook(first, b)
    register_grad_ready_hook(first, a)  # once per hook and parameter
    register_grad_ready_hook(second, b)
    grad_ready(first, ("shard",), ("ranks",))
    grad_ready(other)  # nothing registered: nothing runs
    assert seen == [("a", ("shard",), ("ranks",)), ("b", ("shard",), ("ranks",))]
    assert has_grad_ready_hook(first) and has_grad_ready_hook(second) and not has_grad_ready_hook(other)


def test_the_in_backward_package_registers_on_each_parameter_it_steps():
    weight, untouched = tp.nn.Parameter(tp.ones(2)), tp.nn.Parameter(tp.ones(2))
    optim.apply_optimizer_in_backward(tp.optim.SGD, [weight], {"lr": 0.5}, register_hook=False)
    assert has_grad_ready_hook(weight) and not has_grad_ready_hook(untouched)
    weight.grad = tp.ones(2)  # a front end wrote the final gradient and says so through the hook point
    grad_ready(weight)
    assert torch.equal(weight.detach(), torch.full((2,), 0.5)) and weight.grad is None


def test_apply_optimizer_in_backward_is_the_module_and_calls_as_the_function():
    assert optim.apply_optimizer_in_backward is in_backward_module  # PyTorch's path: the module
    assert isinstance(in_backward_module, types.ModuleType) and callable(in_backward_module)
    assert inspect.signature(in_backward_module) == inspect.signature(optim._apply_optimizer_in_backward)
    from tensorplay.distributed.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    assert apply_optimizer_in_backward is optim._apply_optimizer_in_backward  # the module's own name: the function
    weight = tp.nn.Parameter(tp.ones(2))
    in_backward_module(tp.optim.SGD, [weight], {"lr": 0.25})  # the seeds' call form
    (weight * 2).sum().backward()
    assert torch.equal(weight.detach(), torch.full((2,), 0.5)) and weight.grad is None
