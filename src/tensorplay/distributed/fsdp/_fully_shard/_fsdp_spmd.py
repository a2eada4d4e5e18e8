"""Where a sharded parameter lives: its DTensor mesh and placements, plain or over tensor parallelism.

[Note: fully_shard over tensor parallelism]
A parameter that already is a DTensor (``parallelize_module`` on the ``tp``
dim of a mesh) is sharded over the data-parallel mesh by its *local* tensor:
the flat buffers, the all-gather and the reduce-scatter see only this rank's
TP shard, exactly as for a plain parameter of that shape. Only the metadata
differs. The sharded parameter is a DTensor on the mesh ``dp x tp`` (the two
sub-meshes concatenated; they must come from one root mesh) whose placements
are the data-parallel placement followed by the TP placements. When the TP
placements also shard the data-parallel shard dim (a Colwise weight: TP
Shard(0), dp Shard(0)), the dp shard is a shard *of the TP shard*, so the
data-parallel placement is ``_StridedShard(dim, split_factor=<TP shards on
that dim>)``, the layout PyTorch's fully_shard gives. The unsharded parameter
used in compute is the TP DTensor again (the TP mesh and placements), and its
gradient is brought back to the TP placements (e.g. a Partial sum all-reduced
over tp) before the data-parallel reduce-scatter of its local tensor.

With ``dp_mesh_dims`` the parameter is instead a DTensor on the full mesh,
``Replicate()`` on the data-parallel dims: the sharded parameter lives on that
same mesh with the shard dim's Replicate turned into the (strided) shard, and
the gradient keeps its own placement on the data-parallel dims (a Partial there
is summed by the reduce-scatter, as in PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import tensorplay.distributed as dist

from ._fsdp_common import MeshInfo

#: PyTorch's limit too: one TP dim, or EP and TP.
_MAX_TP_DIMS = 2


@dataclass(frozen=True)
class TPLayout:
    """The TP DTensor a parameter was before fully_shard: what compute sees after the all-gather."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    size: torch.Size  # global
    stride: tuple[int, ...]  # global, contiguous
    dp_dims: frozenset[int] = frozenset()  # on a full SPMD mesh (dp_mesh_dims): the data-parallel mesh dims

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's TP shard) as the TP DTensor."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.size,
                                  stride=self.stride)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of ``grad`` in the TP placements (a Partial gradient is reduced over tp first).

        On a full SPMD mesh the data-parallel dims keep the gradient's own
        placement: the reduce-scatter over them follows, as in PyTorch.
        """
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(g if i in self.dp_dims else p
                       for i, (g, p) in enumerate(zip(grad.placements, self.placements, strict=True)))
        if tuple(grad.placements) != target:
            grad = grad.redistribute(self.mesh, target)
        return grad._local_tensor


@dataclass(frozen=True)
class ShardedLayout:
    """The sharded parameter's DTensor metadata; ``tp`` is None for a plain (non-DTensor) parameter."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    size: torch.Size  # global
    stride: tuple[int, ...]
    tp: TPLayout | None

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's data-parallel shard of its TP shard) as the sharded DTensor."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.size,
                                  stride=self.stride)


def local_tensor(param: nn.Parameter) -> torch.Tensor:
    """What fully_shard shards: the parameter itself, or a DTensor's local tensor."""
    return param._local_tensor if isinstance(param, DTensor) else param


def sharded_layout(param: nn.Parameter, fqn: str, mesh_info: MeshInfo, shard_dim: int,
                   meshes: dict[int, DeviceMesh]) -> ShardedLayout:
    """The sharded DTensor's mesh and placements; ``meshes`` caches the ``dp x tp`` meshes of one call."""
    size = param.shape
    stride = contiguous_stride(size)
    if mesh_info.dp_mesh_dims is not None:
        return _spmd_layout(param, fqn, mesh_info, shard_dim)
    if not isinstance(param, DTensor):
        return ShardedLayout(mesh_info.mesh, mesh_info.placements(shard_dim), size, stride, None)
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    _check_tp(fqn, mesh_info.mesh, tp_mesh, tp_placements)
    if id(tp_mesh) not in meshes:
        meshes[id(tp_mesh)] = _concatenate(fqn, mesh_info.mesh, tp_mesh)
    split_factor = param._spec.num_shards_map[shard_dim]
    dp_shard: Placement = _StridedShard(shard_dim, split_factor=split_factor) if split_factor > 1 \
        else Shard(shard_dim)
    dp_placements = mesh_info.placements(shard_dim)[:-1] + (dp_shard,)
    tp = TPLayout(tp_mesh, tp_placements, size, stride)
    return ShardedLayout(meshes[id(tp_mesh)], dp_placements + tp_placements, size, stride, tp)


def _spmd_layout(param: nn.Parameter, fqn: str, mesh_info: MeshInfo, shard_dim: int) -> ShardedLayout:
    """``dp_mesh_dims``: the parameter is a DTensor on the full mesh, Replicate on the data-parallel dims; the
    sharded one shards the shard dim's Replicate (strided when later dims shard the same tensor dim)."""
    mesh, dims = mesh_info.spmd_mesh, mesh_info.dp_mesh_dims
    if not isinstance(param, DTensor):
        message = (f"fully_shard: when dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
                   f"mesh; parameter '{fqn}' is a plain tensor (distribute it on {mesh}, e.g. with "
                   f"distribute_module, or pass it in ignored_params)")
        raise ValueError(message)  # noqa: TRY004 - PyTorch's type for this error
    if param.device_mesh != mesh:
        raise ValueError(f"fully_shard: parameter '{fqn}' is a DTensor on {param.device_mesh}; expected the mesh "
                         f"passed to fully_shard with dp_mesh_dims ({mesh})")
    names = mesh.mesh_dim_names
    assert dims is not None and names is not None  # mesh_info_from checked both for dp_mesh_dims
    placements = tuple(param.placements)
    dp_dims = [names.index(n) for n in (*dims.shard_names, *dims.replicate_names)]
    for index in dp_dims:
        if not isinstance(placements[index], Replicate):
            raise ValueError(f"fully_shard: parameter '{fqn}' has {placements[index]} on the data-parallel mesh dim "  # noqa: TRY004
                             f"'{names[index]}'; expected Replicate() there (placements {placements})")
    shard_index = names.index(dims.shard_names[0])
    split_factor = 1
    for index in range(shard_index + 1, mesh.ndim):
        later = placements[index]
        if isinstance(later, (Shard, _StridedShard)) and later.dim == shard_dim:
            split_factor *= mesh.size(index)
    sharded = list(placements)
    sharded[shard_index] = _StridedShard(shard_dim, split_factor=split_factor) if split_factor > 1 \
        else Shard(shard_dim)
    size, stride = param.shape, contiguous_stride(param.shape)
    tp = TPLayout(mesh, placements, size, stride, frozenset(dp_dims))
    return ShardedLayout(mesh, tuple(sharded), size, stride, tp)


def _check_tp(fqn: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
    """Refuse a DTensor parameter that cannot be sharded over ``dp_mesh`` (named by ``fqn``, with the fix)."""
    where = f"fully_shard: parameter '{fqn}' is a DTensor on {tp_mesh}"
    if tp_mesh.mesh_dim_names is None or dp_mesh.mesh_dim_names is None:
        raise ValueError(f"{where}; sharding it over the data-parallel mesh {dp_mesh} needs both to be named "
                         f"dims of one mesh: init_device_mesh(..., mesh_dim_names=('dp', 'tp')), then "
                         f"parallelize_module(..., mesh['tp']) and fully_shard(..., mesh=mesh['dp'])")
    shared = set(tp_mesh.mesh_dim_names) & set(dp_mesh.mesh_dim_names)
    if shared:
        raise ValueError(f"{where}, which overlaps the data-parallel mesh {dp_mesh} on dims {sorted(shared)}; "
                         f"fully_shard's mesh must be the data-parallel dims only (e.g. mesh['dp'])")
    if not _orthogonal(dp_mesh, tp_mesh):
        raise ValueError(f"{where}, which is not a sub-mesh of the same mesh as the data-parallel mesh {dp_mesh}; "
                         f"take both from one mesh: mesh['tp'] for parallelize_module, mesh['dp'] for fully_shard")
    if len(placements) > _MAX_TP_DIMS:
        raise ValueError(f"{where} with placements {placements}; fully_shard supports a DTensor on 1 or 2 model-"
                         f"parallel dims (TP, or EP and TP)")
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"{where} with a Partial placement {placements}; a parameter must be Shard or "
                         f"Replicate: redistribute it first")


def _orthogonal(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> bool:
    """Whether the two meshes are different dims of one mesh as seen from this rank: their groups meet only here.

    Compared by ranks, not by root-mesh identity: PyTorch caches sub-meshes by layout and names, so ``mesh["tp"]``
    of a second mesh of the same layout may carry the first mesh as its root.
    """
    dp_ranks = set(dp_mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    return dp_ranks & tp_ranks == {dist.get_rank()}


def _concatenate(fqn: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    try:
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except RuntimeError as err:
        raise ValueError(f"fully_shard: cannot combine the data-parallel mesh {dp_mesh} with the mesh {tp_mesh} of "
                         f"DTensor parameter '{fqn}' ({err}); take both from one mesh: mesh['dp'], mesh['tp']"
                         ) from err


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(size):
        stride.append(acc)
        acc *= dim
    return tuple(reversed(stride))
