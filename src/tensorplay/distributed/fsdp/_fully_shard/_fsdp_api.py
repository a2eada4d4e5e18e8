"""Policies passed to :func:`fully_shard`: mixed precision and offloading (values, not flags).

Each is also an instance of PyTorch's class of the same name ([Note: type identity only]); the offload
policies are mutable dataclasses as PyTorch's are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._checks.validation import check_bool, check_dtype
from tensorplay.distributed._sharding.placement import Placement
from tensorplay.distributed._torch_identity import identity_only, twin

from .. import _torch_types as torch_fsdp

__all__ = ["AllGather", "CPUOffloadPolicy", "Comm", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy",
           "ReduceScatter"]

_ReduceOp = dist.ReduceOp | dist.ReduceOp.RedOpType


@twin(torch_fsdp.MixedPrecisionPolicy)
@identity_only
@dataclass(frozen=True)
class MixedPrecisionPolicy(torch_fsdp.MixedPrecisionPolicy):
    """Dtypes for the all-gathered parameters, the gradient reduction and the module outputs.

    ``param_dtype``: dtype of the unsharded parameters used in forward/backward
    (the sharded parameters keep their original dtype). ``reduce_dtype``: dtype
    of the gradient reduce-scatter (default: ``param_dtype``). ``output_dtype``:
    dtype floating-point forward outputs are cast to. ``cast_forward_inputs``:
    cast floating-point forward inputs to ``param_dtype``.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        >>> policy = MixedPrecisionPolicy(param_dtype=tp.bfloat16, reduce_dtype=tp.float32)
        >>> model = fully_shard(tp.nn.Linear(8, 4), mp_policy=policy)
        >>> model(tp.randn(2, 8)).dtype                # computed in bfloat16; the sharded parameters stay float32
        torch.bfloat16
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            check_dtype(getattr(self, name), name, "MixedPrecisionPolicy")
        check_bool(self.cast_forward_inputs, "cast_forward_inputs", "MixedPrecisionPolicy")


@twin(torch_fsdp.OffloadPolicy)
@identity_only
@dataclass
class OffloadPolicy(torch_fsdp.OffloadPolicy):
    """No offloading: sharded parameters and gradients live on the mesh's device.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import OffloadPolicy, fully_shard
        >>> model = fully_shard(tp.nn.Linear(8, 4), offload_policy=OffloadPolicy())   # the default: no offload
    """

    def placement(self, compute_device: torch.device) -> Placement:
        """Where the sharded parameters and gradients live, for a group computing on ``compute_device``."""
        return Placement.on(compute_device)


@twin(torch_fsdp.CPUOffloadPolicy)
@identity_only
@dataclass
class CPUOffloadPolicy(OffloadPolicy, torch_fsdp.CPUOffloadPolicy):
    """Keep sharded parameters and gradients on the CPU; the optimizer steps there.

    Each all-gather copies the shard to the compute device and each
    reduce-scatter's result comes back to the CPU. ``pin_memory`` pins the CPU
    tensors for faster copies; unlike PyTorch's, it is ignored (instead of
    failing) on a machine without an accelerator, where nothing can be pinned.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import CPUOffloadPolicy, fully_shard
        >>> model = fully_shard(tp.nn.Linear(8, 4), offload_policy=CPUOffloadPolicy())   # works without a GPU too
        >>> model(tp.randn(2, 8)).sum().backward()
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        check_bool(self.pin_memory, "pin_memory", "CPUOffloadPolicy")

    def placement(self, compute_device: torch.device) -> Placement:
        return Placement.on(compute_device, offload=True, pin_memory=self.pin_memory)


class Comm(ABC):
    """A user-supplied collective for :meth:`FSDPModule.set_custom_all_gather` / ``set_custom_reduce_scatter``.

    ``allocate`` makes the communication buffer (so an implementation may
    reuse one, or allocate from a special pool such as NCCL's); ``__call__``
    runs the collective into it.
    """

    @abstractmethod
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A buffer of ``size`` / ``dtype`` on ``device`` for one collective."""
        ...


class AllGather(Comm):
    """Gathers every rank's 1D ``input_tensor`` into ``output_tensor`` (1D, world x input), rank-major."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None: ...


class ReduceScatter(Comm):
    """Reduces ``input_tensor`` (1D, world x output) with ``op`` and keeps this rank's chunk in ``output_tensor``."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: _ReduceOp, async_op: bool = False) -> dist.Work | None: ...


@twin(torch_fsdp.DataParallelMeshDims)
@identity_only
@dataclass
class DataParallelMeshDims(torch_fsdp.DataParallelMeshDims):
    """Which named dims of a full SPMD mesh are data parallel, for ``fully_shard(mesh, dp_mesh_dims=...)``.

    ``shard``: the dim name(s) fully_shard shards parameters over; ``replicate``:
    the dim name(s) they are replicated over (HSDP). At least one is needed.
    Parameters must then be DTensors on that mesh, ``Replicate()`` on these dims.

    Example:
        >>> from tensorplay.distributed.fsdp import DataParallelMeshDims
        >>> DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")   # HSDP over two named dims
        DataParallelMeshDims(shard='dp_shard', replicate='dp_replicate')
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims: at least one of shard or replicate must be set, e.g. "
                             "DataParallelMeshDims(shard='dp')")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)
