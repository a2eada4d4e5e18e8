"""Memory the sharding layer lets go of without waiting for the garbage collector, against PyTorch's.

With the collector off (a reference cycle then never frees), after ``fully_shard`` and the
classic ``FullyShardedDataParallel`` the original, unsharded parameters are gone, as they
are after PyTorch's; and after a training step the shared-memory transport holds no
reduce-scatter input. Found by a census of live tensors: a recursive walk
(a closure that calls itself) kept every original parameter alive until the collector's
next full pass, and the arena's last operation kept its buffers between steps.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import tensorplay.distributed.fsdp as fsdp
from tensorplay import nn
from tensorplay.distributed._comm import collectives
from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
from tensorplay.testing.distributed import run_distributed


@contextmanager
def _collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)))


def _fully_shard(impl: str, model: nn.Module) -> nn.Module:
    fully_shard = fsdp.fully_shard if impl == "ours" else torch_fsdp.fully_shard
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def _classic(impl: str, model: nn.Module, use_orig_params: bool = False) -> nn.Module:
    cls = fsdp.FullyShardedDataParallel if impl == "ours" else torch_fsdp.FullyShardedDataParallel
    policy = ModuleWrapPolicy if impl == "ours" else torch_fsdp.wrap.ModuleWrapPolicy
    return cls(model, auto_wrap_policy=policy({nn.Linear}), use_orig_params=use_orig_params,
               device_id=torch.device("cpu"))  # PyTorch needs the CPU named when no accelerator is there


def _classic_orig_params(impl: str, model: nn.Module) -> nn.Module:
    return _classic(impl, model, use_orig_params=True)


WRAPPERS: dict[str, Callable[[str, nn.Module], nn.Module]] = {
    "fully_shard": _fully_shard, "classic": _classic, "classic use_orig_params": _classic_orig_params}


def originals_alive(wrapper: str, impl: str) -> int:
    """How many of the model's original parameter tensors still hold their memory right after sharding.

    The collector is off, so memory held only by a reference cycle counts as held. A parameter
    object may live on (``use_orig_params=True`` keeps it) as long as its data is a new, sharded one.
    """
    warm_up = WRAPPERS[wrapper](impl, _model())  # lazy imports (torch._dynamo) run here:
    del warm_up  # the import machinery's frames, caught in a cycle by torch.fx, would hold the first call's locals
    with _collector_off():
        model = _model()
        originals = [(weakref.ref(p), p.untyped_storage().data_ptr()) for p in model.parameters()]
        sharded = WRAPPERS[wrapper](impl, model)
        alive = 0
        for ref, data_ptr in originals:
            param = ref()
            alive += param is not None and param.untyped_storage().data_ptr() == data_ptr
        del sharded, model, param
    return alive


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_sharding_frees_the_original_parameters_without_the_collector(wrapper: str) -> None:
    ours = run_distributed(originals_alive, wrapper, "ours")
    theirs = run_distributed(originals_alive, wrapper, "torch")
    assert theirs == [0, 0]
    assert ours == theirs


def reduce_inputs_kept_after_a_step() -> list[int]:
    """Which of the step's reduce-scatter inputs are alive once it is over (the outputs become the gradients)."""
    saved = collectives.PLANS["gloo"]
    collectives.set_collective_plan("gloo", all_gather="shared_memory", reduce_scatter="shared_memory")
    kept: list[Any] = []
    original = collectives.reduce_scatter_flat

    def recording(output: torch.Tensor, full: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        kept.append(weakref.ref(full))
        return original(output, full, *args, **kwargs)

    try:
        with _collector_off():
            model = _fully_shard("ours", _model())
            group = model[0]._get_fsdp_state().group
            group.buffers.keep = 0  # the pool keeps nothing idle: what stays alive is held elsewhere
            collectives.reduce_scatter_flat = recording
            model(torch.randn(4, 64)).sum().backward()
            collectives.reduce_scatter_flat = original
            alive = [i for i, ref in enumerate(kept) if ref() is not None]
            assert len(kept) == 2  # one reduce-scatter per group with parameters
            del model, group
    finally:
        collectives.reduce_scatter_flat = original
        collectives.PLANS["gloo"] = saved
    return alive


def test_no_reduce_scatter_buffer_outlives_the_step() -> None:
    assert run_distributed(reduce_inputs_kept_after_a_step) == [[], []]
