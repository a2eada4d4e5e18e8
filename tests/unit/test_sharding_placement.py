"""The one offload model (_sharding.placement), the accelerator question (devices) and casting (casting)."""

from __future__ import annotations

import pytest
import torch

from tensorplay.distributed._sharding import devices
from tensorplay.distributed._sharding.casting import cast_floating
from tensorplay.distributed._sharding.placement import Placement
from tensorplay.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy
from tensorplay.distributed.fsdp._classic.placement import placement_for

CPU, META = torch.device("cpu"), torch.device("meta")


def test_both_front_ends_build_the_same_placement():
    assert placement_for(META, CPUOffload(offload_params=True)) == CPUOffloadPolicy(pin_memory=False).placement(META)
    assert placement_for(META, None) == placement_for(META, CPUOffload()) == OffloadPolicy().placement(META)
    assert placement_for(META, None) == Placement(META, META)
    assert CPUOffloadPolicy().placement(META) == Placement(CPU, META, pin_memory=True)


def test_to_storage_and_to_compute_move_only_when_the_devices_differ():
    tensor = torch.arange(4.0)
    same = Placement.on(CPU)
    assert same.to_storage(tensor) is tensor and same.to_compute(tensor) is tensor
    offloaded = Placement.on(META, offload=True)
    assert offloaded.to_compute(tensor).device == META and offloaded.to_storage(tensor) is tensor


def test_pinning_is_skipped_without_an_accelerator(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert devices.current_accelerator() is None
    placed = Placement.on(CPU, offload=True, pin_memory=True).to_storage(torch.arange(3.0))
    assert not placed.is_pinned() and torch.equal(placed, torch.arange(3.0))


def test_current_accelerator_names_the_type_and_index(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    assert devices.current_accelerator() == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert devices.ranks_per_node() == 4


def test_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert devices.ranks_per_node() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert devices.ranks_per_node() is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_cast_floating_casts_only_floating_tensors(dtype):
    tree = {"x": torch.ones(2), "i": torch.ones(2, dtype=torch.int64), "n": 3, "l": [torch.zeros(1, dtype=dtype)]}
    out = cast_floating(dtype, tree)
    assert out["x"].dtype == dtype and out["i"].dtype == torch.int64 and out["n"] == 3
    assert out["l"][0] is tree["l"][0]  # already the dtype: the same tensor
