"""``ShardedTensor`` values: the form PyTorch's classic FSDP gives sharded state dicts by default.

A parameter (or optimizer state) is cut along dim 0 into ``ceil(rows / world)``
row chunks, one per rank of the group, as ``torch.chunk`` cuts it (trailing
ranks may hold none); the global metadata is computed locally, no collective.
"""

from __future__ import annotations

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

import tensorplay.distributed as dist

from ..._comm.collectives import all_reduce
from ..._sharding.layout import rank_slice


def chunk_sharded_tensor(full: torch.Tensor, group: dist.ProcessGroup, offload_to_cpu: bool) -> ShardedTensor:
    """This rank's dim-0 chunk of ``full`` as a ``ShardedTensor`` over ``group``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device("cpu") if offload_to_cpu else full.device
    tail = [0] * (full.dim() - 1)
    shards_metadata, local = [], []
    for member in range(world):
        part = rank_slice(full.shape[0], world, member)
        if part.size == 0:
            continue
        placement = f"rank:{dist.get_global_rank(group, member)}/{device}"
        shard_metadata = ShardMetadata([part.start, *tail], [part.size, *full.shape[1:]], placement)
        shards_metadata.append(shard_metadata)
        if member == rank:
            local.append(Shard(full.detach().narrow(0, part.start, part.size).clone().to(device), shard_metadata))
    properties = TensorProperties(dtype=full.dtype, layout=full.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_metadata, full.size(), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def full_tensor(value: ShardedTensor, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """The whole tensor of a ``ShardedTensor`` whose shards are disjoint (collective over ``group``)."""
    properties = value.metadata().tensor_properties
    full = torch.zeros(value.size(), dtype=properties.dtype, device=device)
    for shard in value.local_shards():
        where = tuple(slice(offset, offset + size) for offset, size in
                      zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True))
        full[where].copy_(shard.tensor)
    # Every rank adds its placed shards: the sum assembles the tensor.
    all_reduce(full, group)
    return full
