"""The tensor core is PyTorch's own objects; the owned subtrees are ours."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest
import torch

import tensorplay as tp
from tensorplay import _alias


def test_core_objects_are_pytorchs():
    assert tp.Tensor is torch.Tensor
    assert tp.randn is torch.randn and tp.zeros is torch.zeros
    assert tp.float32 is torch.float32 and tp.bfloat16 is torch.bfloat16
    assert tp.nn.Linear is torch.nn.Linear
    assert tp.nn.functional is torch.nn.functional
    assert tp.nn.parallel.DistributedDataParallel is torch.nn.parallel.DistributedDataParallel
    for name in ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Rprop"):
        assert getattr(tp.optim, name) is getattr(torch.optim, name)
    assert tp.cuda is torch.cuda and tp.amp is torch.amp
    assert tp.manual_seed is torch.manual_seed
    assert tp.save.__module__ == tp.load.__module__ == "tensorplay._serialization"  # ours: checked load


def test_import_forms():
    import tensorplay.nn as nn
    from tensorplay.nn.parallel import DistributedDataParallel

    assert nn is torch.nn
    assert DistributedDataParallel is torch.nn.parallel.DistributedDataParallel


def test_no_torch_module_is_imported_twice():
    import tensorplay.distributed.algorithms.join  # noqa: F401
    import tensorplay.distributed.rpc  # noqa: F401
    import tensorplay.nn.parallel  # noqa: F401

    for name, module in list(sys.modules.items()):
        if not name.startswith("tensorplay") or module is None:
            continue
        file = getattr(module, "__file__", None) or ""
        if module.__name__.startswith("torch"):
            # An alias must be the very object torch registered, not a re-execution.
            assert sys.modules[module.__name__] is module, name
        else:
            assert "site-packages/torch" not in file, f"{name} is a second copy of {file}"
    assert torch.nn.parallel.__spec__.name == "torch.nn.parallel"


def test_distributed_substrate_is_pytorchs():
    import tensorplay.distributed as dist
    import tensorplay.distributed.autograd as dist_autograd
    import tensorplay.distributed.checkpoint as dcp
    import tensorplay.distributed.rpc as rpc
    from tensorplay.distributed.algorithms.join import Join
    from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
    from tensorplay.distributed.nn import RemoteModule
    from tensorplay.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    td = torch.distributed
    for name in ("init_process_group", "destroy_process_group", "get_rank", "get_world_size", "new_group",
                 "new_subgroups", "all_reduce", "all_gather", "reduce_scatter_tensor", "broadcast", "barrier",
                 "ProcessGroup", "ReduceOp", "is_available", "is_initialized"):
        assert getattr(dist, name) is getattr(td, name), name
    assert rpc is td.rpc and dist_autograd is td.autograd
    # The checkpoint package is ours (safe save/load); its planners and metadata types are PyTorch's objects.
    assert dcp.__name__ == "tensorplay.distributed.checkpoint" and dcp.save is not td.checkpoint.save
    assert dcp.DefaultLoadPlanner is td.checkpoint.DefaultLoadPlanner and dcp.Metadata is td.checkpoint.Metadata
    assert Join is td.algorithms.join.Join and RemoteModule is td.nn.RemoteModule
    assert DeviceMesh is td.device_mesh.DeviceMesh and init_device_mesh is td.device_mesh.init_device_mesh
    assert (DTensor, Shard, Replicate, distribute_tensor) == (
        td.tensor.DTensor, td.tensor.Shard, td.tensor.Replicate, td.tensor.distribute_tensor)


def _owned_modules():
    for root in _alias.OWNED_SUBTREES:
        package = importlib.import_module(root)
        yield package
        for info in pkgutil.walk_packages(package.__path__, prefix=root + "."):
            yield importlib.import_module(info.name)


FORBIDDEN = ("torch.distributed.optim", "torch.distributed.fsdp", "torch.distributed.algorithms.model_averaging",
             "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.algorithms._")


def _is_private(module_name: str) -> bool:
    return any(part.startswith("_") for part in module_name.split("."))


def test_owned_subtrees_are_ours():
    """Public names (``__all__``) under the owned subtrees are defined here, and no module
    there holds anything of PyTorch's versions of those subtrees."""
    for module in _owned_modules():
        assert module.__name__.startswith("tensorplay."), module
        assert "site-packages/torch" not in (module.__file__ or "")
        if module.__name__.endswith("._torch_types"):
            continue  # DESIGN's type-identity clause: PyTorch's classes as bases, in this one module per subtree
        for name, obj in vars(module).items():
            owner = getattr(obj, "__name__" if isinstance(obj, type(sys)) else "__module__", None) or ""
            assert not owner.startswith(FORBIDDEN), f"{module.__name__}.{name} comes from {owner}"
        if _is_private(module.__name__):
            continue
        assert hasattr(module, "__all__"), f"public module {module.__name__} must declare __all__"
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type(sys)):
                assert obj.__name__.startswith("tensorplay."), f"{module.__name__}.{name} is {obj.__name__}"
            elif isinstance(obj, type) or callable(obj):
                owner = getattr(obj, "__module__", "") or ""
                assert owner.startswith("tensorplay"), f"{module.__name__}.{name} comes from {owner}"


def test_owned_subtree_never_falls_through():
    with pytest.raises(ImportError):
        importlib.import_module("tensorplay.distributed.optim.no_such_module")
    with pytest.raises(ImportError):
        importlib.import_module("tensorplay.distributed.fsdp._no_such_private_module")
    import tensorplay.distributed as dist

    assert dist.algorithms.__name__ == "tensorplay.distributed.algorithms"
    assert dist.optim.__name__ == "tensorplay.distributed.optim"
