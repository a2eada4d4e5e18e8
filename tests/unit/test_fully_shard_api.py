"""fully_shard's public surface and policies, in one process."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import tensorplay as tp
import tensorplay.distributed.fsdp as fsdp
from tensorplay.distributed.fsdp import _fully_shard

PUBLIC = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
          "CPUOffloadPolicy", "register_fsdp_forward_method"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_are_ours(name):
    obj = getattr(fsdp, name)
    assert obj is getattr(_fully_shard, name)
    assert name in fsdp.__all__ and name in _fully_shard.__all__
    assert obj.__module__.startswith("tensorplay.distributed.fsdp._fully_shard")
    assert obj is not getattr(torch_fsdp, name, None)


def test_signature_matches_pytorch():
    ours = inspect.signature(fsdp.fully_shard).parameters
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    shared = list(theirs)
    assert list(ours) == shared
    for name in shared:
        assert ours[name].kind == theirs[name].kind, name
        if name in ("mesh", "reshard_after_forward", "shard_placement_fn", "ignored_params"):
            assert ours[name].default is None


def test_mixed_precision_policy_defaults_and_frozen():
    policy = fsdp.MixedPrecisionPolicy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs) == \
        (None, None, None, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = tp.bfloat16


def test_offload_policies_place_tensors():
    tensor = tp.arange(4.0)
    none = fsdp.OffloadPolicy().placement(torch.device("cpu"))
    assert none.to_storage(tensor) is tensor and none.storage_device == torch.device("cpu")
    cpu = fsdp.CPUOffloadPolicy()
    assert cpu.pin_memory is True and isinstance(cpu, fsdp.OffloadPolicy)
    # PyTorch's pin_memory=True fails without an accelerator; ours keeps an unpinned CPU tensor.
    placed = cpu.placement(torch.device("cpu")).to_storage(tensor)
    assert placed.device.type == "cpu" and torch.equal(placed, tensor)
    offloaded = cpu.placement(torch.device("meta"))
    assert (offloaded.storage_device, offloaded.compute_device) == (torch.device("cpu"), torch.device("meta"))
    assert fsdp.OffloadPolicy().placement(torch.device("meta")).storage_device == torch.device("meta")


def test_register_forward_method_is_noop_without_fully_shard():
    module = tp.nn.Linear(2, 2)
    fsdp.register_fsdp_forward_method(module, "forward")
    assert "forward" not in module.__dict__


def test_fsdp_class_is_subclass_of_both():
    cls = _fully_shard._fully_shard._fsdp_class(tp.nn.Linear)
    assert issubclass(cls, tp.nn.Linear) and issubclass(cls, fsdp.FSDPModule) and cls.__name__ == "FSDPLinear"
    assert _fully_shard._fully_shard._fsdp_class(tp.nn.Linear) is cls
