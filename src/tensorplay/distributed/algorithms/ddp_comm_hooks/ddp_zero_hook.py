"""DDP communication hooks that run ZeroRedundancyOptimizer's step inside DDP's backward.

Register one on the DDP model with a ZeroRedundancyOptimizer built with
``overlap_with_ddp=True``::

    zero = ZeroRedundancyOptimizer(ddp.parameters(), tp.optim.Adam, overlap_with_ddp=True, lr=1e-3)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))

Each bucket's update starts once its all-reduce is done; its broadcast then
overlaps the rest of backward. Unlike PyTorch's, both hooks work on Gloo:
every collective is issued from the backward thread in bucket order (see
[Note: collective order on Gloo] in ``tensorplay.distributed.optim._zero_overlap``).

DDP compares a hook's annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so annotations here stay real (no
``from __future__ import annotations``).
"""

import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from tensorplay.distributed.optim import _zero_overlap as overlap
from tensorplay.distributed.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _attach(name: str, ddp: Any, zero: ZeroRedundancyOptimizer, shard_buckets: bool) -> "weakref.ReferenceType":
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(f"{name}: zero must be a ZeroRedundancyOptimizer, got {type(zero).__name__}")
    if zero._overlap is None:
        raise ValueError(f"{name}: the ZeroRedundancyOptimizer was built with overlap_with_ddp=False; build it "
                         f"with overlap_with_ddp=True to step it inside DDP's backward")
    if zero._overlap.hooked:
        raise RuntimeError(f"{name}: this ZeroRedundancyOptimizer already has a ZeRO hook; register one per optimizer")
    zero._overlap.hooked = True
    zero._overlap.shard_buckets = shard_buckets
    return weakref.ref(ddp)


def hook_with_zero_step(hook: Hook, ddp: Any, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> Hook:
    """Wrap ``hook`` so that, once the last bucket is handed over, every bucket is updated (after its
    all-reduce) and broadcast, in bucket order.

    ``shard_buckets=True`` splits each DDP bucket among ranks (about ``total / world_size`` elements
    each) instead of giving each bucket to one rank. The first two iterations only learn DDP's buckets.
    """
    ddp_ref = _attach("hook_with_zero_step", ddp, zero, shard_buckets)
    state = zero._overlap

    def hook_with_zero_fn(process_group: Optional[dist.ProcessGroup],
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(process_group, bucket)
        if not overlap.observe(zero, ddp_ref(), bucket):
            return future
        state.futures[bucket.index()] = future
        if bucket.index() == state.num_buckets - 1:
            for index in range(state.num_buckets):
                overlap.update_and_broadcast(zero, index)
            overlap.finish_iteration(zero)
        return future

    return hook_with_zero_fn


def hook_with_zero_step_interleaved(hook: Hook, ddp: Any, zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False) -> Hook:
    """Wrap ``hook`` so that bucket ``i`` is updated and broadcast as soon as bucket ``i + 1`` is handed
    over (the last one right away), interleaving the updates with backward.

    Same arguments and warm-up as :func:`hook_with_zero_step`.
    """
    ddp_ref = _attach("hook_with_zero_step_interleaved", ddp, zero, shard_buckets)
    state = zero._overlap

    def hook_with_zero_interleaved_fn(process_group: Optional[dist.ProcessGroup],
                                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(process_group, bucket)
        if not overlap.observe(zero, ddp_ref(), bucket):
            return future
        index = bucket.index()
        state.futures[index] = future
        if index > 0:
            overlap.update_and_broadcast(zero, index - 1)
        if index == state.num_buckets - 1:
            overlap.update_and_broadcast(zero, index)
            overlap.finish_iteration(zero)
        return future

    return hook_with_zero_interleaved_fn
