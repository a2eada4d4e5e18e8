"""ZeRO's chunked local step (``_zero_chunked_step``): bitwise equal to the same optimizer stepping per parameter.

One process: the chunking is local to a rank. Parameters lie end to end in one
buffer (as with bucket views) so that small ones merge and large ones split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tensorplay as tp
from tensorplay.distributed.optim.utils import functional_optim_from
from tensorplay.distributed.optim.zero import _chunked_step as chunked_step
from tensorplay.distributed.optim.zero._chunked_step import ChunkedStep, functional_step
from tensorplay.distributed.optim.zero._state import local_state_dict
from tensorplay.distributed.optim.zero._sync import pack_as_views

from tests.common import assert_equal_tensors

#: 64 and 128 merge (multiples of ALIGN), 1000 splits into 4 chunks of 256, 10 and 3x7 stay whole.
SHAPES = [(8, 8), (128,), (10,), (40, 25), (3, 7), (64,)]
CHUNK = 256

CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (tp.optim.SGD, {"lr": 0.05}),
    "sgd_momentum": (tp.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "adam": (tp.optim.Adam, {"lr": 0.01}),
    "adam_amsgrad": (tp.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    "adamw": (tp.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adagrad": (tp.optim.Adagrad, {"lr": 0.1}),
    "adadelta": (tp.optim.Adadelta, {"lr": 0.5}),
    "adamax": (tp.optim.Adamax, {"lr": 0.01}),
    "rmsprop": (tp.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "rprop": (tp.optim.Rprop, {"lr": 0.01}),
    "nadam": (tp.optim.NAdam, {"lr": 0.01}),
    "radam": (tp.optim.RAdam, {"lr": 0.01}),
    "asgd": (tp.optim.ASGD, {"lr": 0.01}),
}


def params(bucketed: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).requires_grad_() for shape in SHAPES]
    if bucketed:
        pack_as_views(tensors)
    return tensors


def set_grads(tensors: list[torch.Tensor], step: int, skip: int | None = None) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for index, tensor in enumerate(tensors):
        grad = torch.randn(tensor.shape, generator=gen)
        tensor.grad = None if index == skip else grad


def run(name: str, chunked: bool, bucketed: bool = True, steps: int = 5,
        skip_at: int | None = None) -> tuple[list[torch.Tensor], dict[str, Any], int]:
    cls, options = CASES[name]
    tensors = params(bucketed)
    optim = cls(tensors, **options)
    stepper = ChunkedStep(optim, CHUNK) if chunked else None
    chunked_steps = 0
    for step in range(steps):
        set_grads(tensors, step, skip=3 if step == skip_at else None)
        if stepper is not None and stepper.step():
            chunked_steps += 1
            continue
        optim.step()
        if stepper is not None:
            stepper.unbind()
    return [t.detach().clone() for t in tensors], optim.state_dict(), chunked_steps


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry), index
        for key, value in entry.items():
            other = got["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(other, value) and other.dtype == value.dtype, (index, key)
            else:
                assert other == value, (index, key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_step_is_bitwise_per_parameter_step(name):
    want_params, want_state, _ = run(name, chunked=False)
    got_params, got_state, chunked_steps = run(name, chunked=True)
    # The first step creates the state, per parameter (Adagrad creates it at construction); plain SGD
    # keeps none, so it never needs chunks.
    assert chunked_steps == {"sgd": 0, "adagrad": 5}.get(name, 4)
    assert_equal_tensors(got_params, want_params, name)
    assert_same_state(got_state, want_state)


def test_plan_splits_large_and_merges_adjacent_aligned_parameters():
    optim = tp.optim.Adam(params(bucketed=True))
    kinds = [("whole" if c.whole else "merged" if c.grad_buffer is not None else "split", c.tensor.numel())
             for c in ChunkedStep(optim, CHUNK).groups[0]]
    assert kinds == [("merged", 192), ("whole", 10), ("split", 256), ("split", 256), ("split", 256),
                     ("split", 232), ("whole", 21), ("whole", 64)]
    unbucketed = ChunkedStep(tp.optim.Adam(params(bucketed=False)), CHUNK).groups[0]
    assert [c.whole for c in unbucketed] == [True, True, True, False, False, False, False, True, True]


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_missing_gradient_steps_per_parameter_and_stays_bitwise(name):
    want_params, want_state, _ = run(name, chunked=False, steps=6, skip_at=3)
    got_params, got_state, chunked_steps = run(name, chunked=True, steps=6, skip_at=3)
    # Step 3 lacks the gradient of a split parameter (per parameter); afterwards that parameter's
    # step count differs from its neighbours', but no chunk mixes it with another parameter.
    assert chunked_steps == 4
    assert_equal_tensors(got_params, want_params, name)
    assert_same_state(got_state, want_state)


def test_loaded_state_is_picked_up():
    tensors = params(bucketed=True)
    optim = tp.optim.Adam(tensors, lr=0.01)
    stepper = ChunkedStep(optim, CHUNK)
    set_grads(tensors, 0)
    optim.step()
    saved = optim.state_dict()
    set_grads(tensors, 1)
    assert stepper.step()
    optim.load_state_dict(saved)  # new state tensors: the chunks must not keep the old ones
    set_grads(tensors, 2)
    assert stepper.step()
    reference = tp.optim.Adam(params(bucketed=True), lr=0.01)
    reference.load_state_dict(saved)
    assert_same_state(optim.state_dict(), _after_one_step(reference, 2))


def _after_one_step(optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    tensors = optim.param_groups[0]["params"]
    set_grads(tensors, step)
    optim.step()
    return optim.state_dict()


FUNCTIONAL = ["sgd_momentum", "adam", "adam_amsgrad", "adamw", "adagrad", "adadelta", "adamax", "rmsprop", "rprop"]


def run_functional(name: str, chunked: bool, steps: int = 4) -> tuple[list[torch.Tensor], dict[str, Any]]:
    cls, options = CASES[name]
    tensors = [t.detach() for t in params(bucketed=False)]
    optim = functional_optim_from(cls, tensors, **options)
    optim.param_groups = [optim.param_group]  # as ZeRO's overlap mode gives it, for local_state_dict
    for step in range(steps):
        set_grads(tensors, step)
        grads = [t.grad for t in tensors]
        if chunked:
            functional_step(optim, tensors, grads)
        else:
            optim.step_params(tensors, grads)
    return tensors, local_state_dict(optim)


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_functional_chunked_step_is_bitwise(name, monkeypatch):
    # ZeRO's DDP-overlap mode and the functional optimizers: large parameters in chunks of CHUNK.
    monkeypatch.setattr(chunked_step, "CHUNK_NUMEL", CHUNK)
    want_params, want_state = run_functional(name, chunked=False)
    got_params, got_state = run_functional(name, chunked=True)
    assert_equal_tensors(got_params, want_params, name)
    assert_same_state(got_state, want_state)
