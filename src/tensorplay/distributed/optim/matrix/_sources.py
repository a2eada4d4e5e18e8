"""The layout of a parameter as a front end shards it: DTensor (fully_shard, TP), classic FSDP views, plain.

Each returns the group the matrix's pieces are exchanged in (None: the whole tensor is here and nothing
is exchanged) and its :class:`~._layout.MatrixLayout` over that group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard, _StridedShardOffsetMode

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup

from ._layout import MatrixLayout, block_region, flat_shard_layout, replicated_layout


@dataclass(frozen=True)
class MatrixSource:
    """One parameter the optimizer updates: its name, whole shape, exchange group and layout over it."""

    param: torch.Tensor
    name: str
    group: ProcessGroup | None
    layout: MatrixLayout

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``tensor`` (the parameter or its gradient) as a plain tensor."""
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor


ClassicLayouts = dict[int, tuple[ProcessGroup | None, MatrixLayout]]


def classic_layouts(module: nn.Module) -> ClassicLayouts:
    """``id(original parameter) -> (shard group, layout)`` for every sharded ``use_orig_params=True`` unit."""
    from tensorplay.distributed.fsdp import FullyShardedDataParallel  # the optimizer package loads first

    found: ClassicLayouts = {}
    for unit in FullyShardedDataParallel.fsdp_modules(module):
        handle = unit._fsdp_state.handle
        if handle is None or not handle.views.per_original():
            continue
        layout = handle.layout
        for param, shape, offset in zip(handle.views.registered(handle), layout.shapes, layout.offsets, strict=True):
            if handle.is_sharded_over_ranks:
                found[id(param)] = (handle.plan.shard_group,
                                    flat_shard_layout(shape, offset, layout.shard_numel, layout.world_size))
            else:  # NO_SHARD: every rank shows the whole tensor (a view of the unsharded flat parameter)
                found[id(param)] = (None, replicated_layout(shape, 1))
    return found


def describe(param: torch.Tensor, name: str, classic: ClassicLayouts) -> MatrixSource:
    """How ``param`` is sharded, whichever front end sharded it."""
    if isinstance(param, DTensor):
        return MatrixSource(param, name, *_dtensor_layout(param, name))
    if id(param) in classic:
        return MatrixSource(param, name, *classic[id(param)])
    if param.untyped_storage().nbytes() != param.numel() * param.element_size():
        raise ValueError(f"parameter {name!r} (shape {tuple(param.shape)}) is a view into a larger buffer, as "
                         "classic FullyShardedDataParallel's use_orig_params=True parameters are: pass "
                         "module=<the FSDP root> so the whole matrix it belongs to is known")
    return MatrixSource(param, name, None, replicated_layout(param.shape, 1))


def _dtensor_layout(param: DTensor, name: str) -> tuple[ProcessGroup, MatrixLayout]:
    mesh, placements = param.device_mesh, param.placements
    for placement in placements:
        if not (isinstance(placement, Shard | _StridedShard) or placement.is_replicate()):
            raise NotImplementedError(f"parameter {name!r}: placements {placements} are not supported by the "
                                      "whole-matrix optimizer (Shard, _StridedShard and Replicate only)")
    group = _whole_mesh_group(mesh, name)
    shape = tuple(param.shape)
    holds, sends = [], []
    for group_rank in range(dist.get_world_size(group)):
        global_rank = dist.get_global_rank(group, group_rank)
        coordinate = [int(c) for c in (mesh.mesh == global_rank).nonzero()[0]]
        offsets, sizes = _local_block(shape, tuple(mesh.shape), coordinate, placements, name)
        holds.append(block_region(shape, offsets, sizes))
        sends.append(all(coordinate[dim] == 0 for dim, p in enumerate(placements) if p.is_replicate()))
    return group, MatrixLayout(shape, tuple(holds), tuple(sends))


def _whole_mesh_group(mesh: dist.DeviceMesh, name: str) -> ProcessGroup:
    """A process group of every rank of ``mesh``, in the mesh's rank order."""
    if mesh.ndim == 1:
        return mesh.get_group()
    ranks = mesh.mesh.flatten().tolist()
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD  # type: ignore[return-value]
    raise NotImplementedError(f"parameter {name!r}: a {mesh.ndim}-D mesh must span the whole world "
                              f"in rank order (mesh ranks {ranks})")


def _local_block(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int],
                 placements: tuple[Placement, ...], name: str) -> tuple[list[int], list[int]]:
    """``(offsets, sizes)`` of the block the rank at ``coordinate`` holds; a strided piece must be contiguous."""
    indices = [list(range(size)) for size in shape]   # the global index of each local row, per tensor dim
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            _, rows = placement._local_shard_size_and_offset(len(indices[placement.dim]), mesh_shape[mesh_dim],
                                                              coordinate[mesh_dim], _StridedShardOffsetMode.ALL)
            rows = rows if isinstance(rows, list) else []   # offset_mode ALL: every local row's index
            indices[placement.dim] = [indices[placement.dim][row] for row in rows]
        elif isinstance(placement, Shard):
            size, start = placement._local_shard_size_and_offset(len(indices[placement.dim]), mesh_shape[mesh_dim],
                                                                 coordinate[mesh_dim])
            indices[placement.dim] = indices[placement.dim][start: start + size]
    for dim, rows in enumerate(indices):
        if rows and rows != list(range(rows[0], rows[0] + len(rows))):
            raise NotImplementedError(f"parameter {name!r}: the shard at mesh coordinate {coordinate} holds "
                                      f"rows {rows} of dim {dim}, not one block (placements {placements})")
    return [rows[0] if rows else 0 for rows in indices], [len(rows) for rows in indices]
