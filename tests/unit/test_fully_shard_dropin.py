"""fully_shard drop-in surface (issue 17): PyTorch 2.13's names and signatures, in one process."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp._fully_shard import _fsdp_api as torch_api

from tensorplay import nn
from tensorplay.distributed import fsdp
from tensorplay.distributed.fsdp._fully_shard import _fsdp_api, _fsdp_common

KNOBS = ["set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook", "set_unshard_in_backward",
         "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params", "set_separate_reduce_scatter_group",
         "set_allocate_memory_from_process_group_for_comm", "set_reduce_scatter_max_input_buffers",
         "set_symm_mem_for_comm"]


def _params(fn) -> list[tuple[str, object, str]]:
    """(name, kind, repr of default) of each parameter: PyTorch's policy defaults are other classes of equal repr."""
    return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(fn).parameters.values()]


def test_fully_shard_signature_equals_pytorch():
    assert _params(fsdp.fully_shard) == _params(torch_fsdp.fully_shard)


@pytest.mark.parametrize("name", [*KNOBS, "unshard", "reshard", "set_requires_gradient_sync",
                                  "set_reshard_after_backward", "set_gradient_divide_factor"])
def test_fsdp_module_method_signature_equals_pytorch(name):
    assert _params(getattr(fsdp.FSDPModule, name)) == _params(getattr(torch_fsdp.FSDPModule, name))


def test_share_comm_ctx_signature_and_bad_input():
    assert _params(fsdp.share_comm_ctx) == _params(torch_fsdp.share_comm_ctx)
    assert fsdp.share_comm_ctx is not torch_fsdp.share_comm_ctx
    fsdp.share_comm_ctx([])  # nothing to share, as in PyTorch
    with pytest.raises(ValueError, match="share_comm_ctx: expects a list of FSDPModules.*Linear"):
        fsdp.share_comm_ctx([nn.Linear(2, 2)])


@pytest.mark.parametrize("name", ["DataParallelMeshDims", "share_comm_ctx"])
def test_new_public_names_are_ours(name):
    assert name in fsdp.__all__ and name in torch_fsdp.__all__
    obj = getattr(fsdp, name)
    assert obj.__module__.startswith("tensorplay.distributed.fsdp._fully_shard")


@pytest.mark.parametrize("kwargs", [{"shard": "dp"}, {"replicate": "r"}, {"shard": ("a", "b"), "replicate": "r"},
                                    {"shard": "dp", "replicate": ("x", "y")}])
def test_data_parallel_mesh_dims_equals_pytorch(kwargs):
    ours, theirs = fsdp.DataParallelMeshDims(**kwargs), torch_fsdp.DataParallelMeshDims(**kwargs)
    assert (ours.shard_names, ours.replicate_names) == (theirs.shard_names, theirs.replicate_names)
    assert repr(ours) == repr(theirs)


def test_data_parallel_mesh_dims_needs_a_dim():
    with pytest.raises(ValueError, match="at least one of shard or replicate"):
        fsdp.DataParallelMeshDims()


@pytest.mark.parametrize("name", ["Comm", "AllGather", "ReduceScatter"])
def test_comm_classes_equal_pytorch(name):
    ours, theirs = getattr(_fsdp_api, name), getattr(torch_api, name)
    assert inspect.isabstract(ours)
    for method in ("allocate", "__call__"):
        if hasattr(theirs, method) and method in vars(theirs):
            assert _params(getattr(ours, method)) == _params(getattr(theirs, method)), method
    with pytest.raises(TypeError):
        ours()


def test_shard_placement_result_fields():
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        ShardPlacementResult as Theirs,
    )

    assert [f for f in Theirs.__dataclass_fields__] == list(_fsdp_common.ShardPlacementResult.__dataclass_fields__)


def test_state_accessor_without_fully_shard_is_none():
    assert fsdp.fully_shard.state(nn.Linear(2, 2)) is None
    assert torch_fsdp.fully_shard.state(nn.Linear(2, 2)) is None
