"""Warnings of the optim subtree: where PyTorch 2.13 warns, ours warns the same category with PyTorch's phrase.

Each case runs PyTorch's object and ours and compares what they warn.
(The post-local SGD "no step counter" warning is covered in tests/parity/test_post_local_sgd.py.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.optim as torch_optim

import tensorplay.distributed.optim as our_optim

FUNCTIONAL = ["_FunctionalAdadelta", "_FunctionalAdagrad", "_FunctionalAdam", "_FunctionalAdamW",
              "_FunctionalAdamax", "_FunctionalRMSprop", "_FunctionalRprop", "_FunctionalSGD"]


def _caught(fn: Callable[[], Any]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return list(caught)


def _relevant(caught: list[warnings.WarningMessage], category: type) -> list[warnings.WarningMessage]:
    # torch.jit's own notices about torch.jit.script are not the functional optimizers' warning.
    return [w for w in caught if issubclass(w.category, category) and "torch.jit." not in str(w.message)]


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_functional_optimizer_construction_warns_like_pytorch(name: str) -> None:
    def build(module: Any) -> Callable[[], Any]:
        return lambda: getattr(module, name)([torch.zeros(3, requires_grad=True)])

    theirs = _relevant(_caught(build(torch_optim)), DeprecationWarning)
    ours = _relevant(_caught(build(our_optim)), DeprecationWarning)
    assert len(theirs) == 1 and len(ours) == 1
    assert str(theirs[0].message) in str(ours[0].message)
    assert ours[0].filename == __file__  # attributed to the code that built it, not to our internals


def test_as_functional_optim_warns_like_pytorch() -> None:
    theirs = _relevant(_caught(lambda: torch_optim.as_functional_optim(torch.optim.Adam, lr=0.1)),
                       DeprecationWarning)
    ours = _relevant(_caught(lambda: our_optim.as_functional_optim(torch.optim.Adam, lr=0.1)), DeprecationWarning)
    assert len(theirs) == len(ours) == 1 and str(theirs[0].message) in str(ours[0].message)
    assert ours[0].filename == __file__


def test_functional_warning_respects_filters() -> None:
    """PyTorch forces its notice through any filter; ours can be silenced."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", DeprecationWarning)
        our_optim._FunctionalSGD([torch.zeros(2, requires_grad=True)])
    assert not caught


def test_named_optimizer_param_groups_warns_like_pytorch() -> None:
    model = torch.nn.Linear(3, 2)

    def build(cls: type) -> Callable[[], Any]:
        return lambda: cls(model.named_parameters(), torch.optim.SGD, [{"params": [model.weight]}], lr=0.1)

    theirs = _relevant(_caught(build(torch_optim._NamedOptimizer)), UserWarning)
    ours = _relevant(_caught(build(our_optim._NamedOptimizer)), UserWarning)
    assert len(theirs) == len(ours) == 1 and str(theirs[0].message) in str(ours[0].message)
