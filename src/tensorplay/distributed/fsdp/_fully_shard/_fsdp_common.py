"""State enums, the mesh description and device helpers shared by the fully_shard classes."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._sharding.devices import current_accelerator
from tensorplay.distributed._sharding.plan import RankGroup, ShardPlan

from ._fsdp_api import DataParallelMeshDims


class InvalidArgumentError(ValueError, AssertionError):
    """Bad input that PyTorch's fully_shard reports with an ``AssertionError``.

    A ``ValueError`` as everywhere else here, and also an ``AssertionError`` so code
    written against PyTorch (``except AssertionError``, its tests) still catches it.
    """


class TrainingState(Enum):
    """Where a parameter group or module state is in the training step."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class ShardedState(Enum):
    """Which form of its parameters a group has registered on its modules.

    ``SHARDED_POST_FORWARD``: resharded after forward to a smaller group
    (``reshard_after_forward`` given as an int); the sharded DTensor is
    registered and backward re-gathers from the smaller group.
    """

    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()


@dataclass(frozen=True, kw_only=True)
class MeshInfo(ShardPlan):
    """The shared :class:`~tensorplay.distributed._sharding.plan.ShardPlan` with the data-parallel mesh it came from.

    The mesh has a shard dim (FSDP) and, for HSDP, a replicate dim before it.
    """

    shard_group: ProcessGroup  # never None: a mesh dim is a group
    mesh: DeviceMesh
    #: With ``fully_shard(spmd_mesh, dp_mesh_dims=...)``: the full mesh the DTensor parameters live on
    #: (``mesh`` is then its data-parallel part) and the data-parallel dim names.
    spmd_mesh: DeviceMesh | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        shard = Shard(shard_dim)
        return (Replicate(), shard) if self.replicate_group is not None else (shard,)


@dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return besides a ``Shard`` or None: a placement and the mesh it is on.

    ``mesh_info``: any object with a ``mesh`` attribute (PyTorch passes its mesh
    description; ours is :class:`MeshInfo`). Only the mesh passed to
    ``fully_shard`` is supported (one group, one mesh); another is refused.
    """

    placement: Shard | None
    mesh_info: Any


ShardPlacementFnResult = Shard | ShardPlacementResult | None


#: The smaller group parameters are resharded to after forward (``reshard_after_forward=int``).
PostForwardInfo = RankGroup


def default_mesh() -> DeviceMesh:
    """A 1D mesh over the default group, on the accelerator when there is one, else the CPU."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: no mesh was given and the default process group is not "
                           "initialized; call tensorplay.distributed.init_process_group() first")
    accelerator = current_accelerator()
    return init_device_mesh(accelerator.type if accelerator is not None else "cpu", (dist.get_world_size(),))


def mesh_info_from(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None = None) -> MeshInfo:
    if dp_mesh_dims is not None:
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return MeshInfo(mesh=mesh, shard_group=group, shard_size=group.size(), shard_rank=group.rank())
    if mesh.ndim == 2:
        shard, replicate = mesh.get_group(1), mesh.get_group(0)
        return MeshInfo(mesh=mesh, shard_group=shard, shard_size=shard.size(), shard_rank=shard.rank(),
                        replicate_group=replicate, replicate_size=replicate.size())
    raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a {mesh.ndim}D mesh of shape "
                     f"{tuple(mesh.shape)}; pass a 1D mesh (FSDP) or a 2D mesh (HSDP: replicate, shard)")


def _spmd_mesh_info(mesh: DeviceMesh, dims: DataParallelMeshDims) -> MeshInfo:
    """The data-parallel part of a full SPMD mesh, named by ``dims`` (one shard dim, optionally one replicate dim)."""
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"fully_shard: dp_mesh_dims={dims} needs a mesh with mesh_dim_names, got {mesh}; "
                         f"build it with init_device_mesh(..., mesh_dim_names=(...))")
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(f"fully_shard: dp_mesh_dims names the mesh dim '{name}', which is not in the mesh's "
                             f"mesh_dim_names {names}")
    if len(dims.shard_names) != 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(f"fully_shard: dp_mesh_dims={dims} is not supported here: give exactly one shard "
                                  f"dim and at most one replicate dim (flattening several dims, or replicate-only "
                                  f"DDP, is not implemented); flatten the dims into one mesh dim first")
    shard_mesh = mesh[dims.shard_names[0]]
    if dims.replicate_names:
        dp_mesh = DeviceMesh._concatenate([mesh[dims.replicate_names[0]], shard_mesh])
        info = mesh_info_from(dp_mesh)
    else:
        info = mesh_info_from(shard_mesh)
    return dataclasses.replace(info, spmd_mesh=mesh, dp_mesh_dims=dims)


# Post-forward subgroups already made, per shard group. Keyed by the rank's own group object, not by
# rank lists alone: ranks that are threads of one process each hold their own group objects, and a
# group made by one thread-rank is unusable by another (it hung PyTorch's thread-rank tests).
_SUBGROUPS: weakref.WeakKeyDictionary[ProcessGroup, dict[tuple[tuple[int, ...], int], ProcessGroup]] = (
    weakref.WeakKeyDictionary())


def with_reshard(mesh_info: MeshInfo, reshard_after_forward: bool | int) -> MeshInfo:
    """``mesh_info`` with its reshard policy: a bool, or an int (the size of the post-forward group)."""
    return dataclasses.replace(mesh_info, reshard_after_forward=bool(reshard_after_forward),
                               post_forward=post_forward_info(reshard_after_forward, mesh_info))


def post_forward_info(reshard_after_forward: bool | int, mesh_info: MeshInfo) -> PostForwardInfo | None:
    """The post-forward group for an int ``reshard_after_forward``; None for a bool."""
    if isinstance(reshard_after_forward, bool):
        return None
    if not isinstance(reshard_after_forward, int):
        raise ValueError(f"fully_shard: reshard_after_forward must be a bool or an int, got "
                         f"{reshard_after_forward!r}")
    size, world = reshard_after_forward, mesh_info.shard_size
    if size < 1 or world % size:
        raise ValueError(f"fully_shard: reshard_after_forward={size} must divide the shard group size {world}")
    if mesh_info.mesh.mesh.numel() != dist.get_world_size():
        # The rows below would differ between ranks of different sub-meshes, and new_group needs every rank
        # to create the same groups in the same order.
        raise NotImplementedError(f"fully_shard: reshard_after_forward={size} (an int) on a mesh that is part of a "
                                  f"larger one ({mesh_info.mesh}, e.g. mesh['dp'] of a dp x tp mesh) is not "
                                  f"supported; pass True or False")
    # Every rank creates every row's group in the same order (new_group is collective).
    ranks = tuple(mesh_info.mesh.mesh.flatten().tolist())
    made = _SUBGROUPS.setdefault(mesh_info.shard_group, {})
    if (ranks, size) not in made:
        rows = [list(ranks[i: i + size]) for i in range(0, len(ranks), size)]
        made[(ranks, size)], _ = dist.new_subgroups_by_enumeration(rows)
    group = made[(ranks, size)]
    return RankGroup(group, size, group.rank())


def device_from_mesh(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


class CommStreams:
    """Side streams for all-gather and reduce-scatter on an accelerator; nothing on the CPU.

    On CUDA the copy-in and the collective of the next group run on their own
    stream so they overlap the current group's compute; on the CPU, Gloo's
    worker threads already run collectives in the background.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = None if device.type == "cpu" else torch.get_device_module(device.type)
        self.all_gather = self._module.Stream() if self._module is not None else None
        self.reduce_scatter = self._module.Stream() if self._module is not None else None

    def on(self, stream: torch.Stream | None) -> contextlib.AbstractContextManager[None]:
        """Run the block on ``stream`` after the work already queued on the current stream.

        On the CPU (no stream) a plain ``nullcontext``: a generator-based context costs a few microseconds
        per collective per step there.
        """
        return _NO_STREAM if stream is None else self._on(stream)

    @contextlib.contextmanager
    def _on(self, stream: torch.Stream) -> Iterator[None]:
        assert self._module is not None  # streams exist only on an accelerator
        stream.wait_stream(self._module.current_stream())
        with self._module.stream(stream):
            yield

    @staticmethod
    def keep_alive(tensors: list[torch.Tensor | None], stream: torch.Stream | None) -> None:
        """Keep ``tensors`` (made on the current stream) from being reused before ``stream``'s work on them."""
        if stream is not None:
            for tensor in tensors:
                if tensor is not None:
                    tensor.record_stream(stream)

    def join(self, stream: torch.Stream | None) -> None:
        """Make the current stream wait for ``stream``."""
        if stream is not None:
            assert self._module is not None  # streams exist only on an accelerator
            self._module.current_stream().wait_stream(stream)

    @staticmethod
    def mark(stream: torch.Stream | None) -> torch.Event | None:
        """An event after the work queued on ``stream`` so far (None on the CPU), for :meth:`join_at`."""
        return stream.record_event() if stream is not None else None

    def join_at(self, event: torch.Event | None) -> None:
        """Make the current stream wait for the work before ``event`` only, not for what its stream got since."""
        if event is not None:
            assert self._module is not None  # events exist only on an accelerator
            self._module.current_stream().wait_event(event)


_NO_STREAM = contextlib.nullcontext()  # stateless and reentrant: one serves every caller
_STREAMS: dict[torch.device, CommStreams] = {}


def comm_streams(device: torch.device) -> CommStreams:
    if device not in _STREAMS:
        _STREAMS[device] = CommStreams(device)
    return _STREAMS[device]
