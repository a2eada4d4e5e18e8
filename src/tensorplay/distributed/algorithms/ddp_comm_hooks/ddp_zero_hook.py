"""DDP communication hooks that run ZeroRedundancyOptimizer's step inside DDP's backward.

Register one on the DDP model with a ZeroRedundancyOptimizer built with
``overlap_with_ddp=True``::

    zero = ZeroRedundancyOptimizer(ddp.parameters(), tp.optim.Adam, overlap_with_ddp=True, lr=1e-3)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))

Each bucket's update starts once its all-reduce is done; its broadcast then
overlaps the rest of backward. Unlike PyTorch's, both hooks work on Gloo:
every collective is issued from the backward thread in bucket order (see
[Note: collective order on Gloo] in ``tensorplay.distributed.optim.zero._overlap``).

DDP compares a hook's annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so annotations here stay real (no
``from __future__ import annotations``).
"""

import weakref
from collections.abc import Callable
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.distributed.optim.zero import Overlap
from tensorplay.distributed.optim.zero_redundancy_optimizer import (
    ZeroRedundancyOptimizer,
)

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _overlap_of(name: str, zero: ZeroRedundancyOptimizer) -> Overlap:
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(f"{name}: zero must be a ZeroRedundancyOptimizer, got {type(zero).__name__}")
    overlap = zero._overlap
    if overlap is None:
        raise ValueError(f"{name}: the ZeroRedundancyOptimizer was built with overlap_with_ddp=False; build it "
                         f"with overlap_with_ddp=True to step it inside DDP's backward")
    return overlap


def _wrap(name: str, hook: Hook, ddp: Any, zero: ZeroRedundancyOptimizer, shard_buckets: bool,
          schedule: Callable[[Overlap, int], None]) -> Hook:
    """``hook``, then (once ZeRO is set up) ``schedule(overlap, bucket_index)`` to update and broadcast."""
    overlap = _overlap_of(name, zero)
    overlap.attach(name, shard_buckets)
    ddp_ref = weakref.ref(ddp)

    def hook_with_zero_fn(process_group: dist.ProcessGroup | None,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(process_group, bucket)
        ddp = ddp_ref()
        assert ddp is not None  # the hook is owned by the live DDP module
        if overlap.on_bucket(ddp, bucket, future):
            schedule(overlap, bucket.index())
        return future

    return hook_with_zero_fn


def _all_at_last_bucket(overlap: Overlap, index: int) -> None:
    last = overlap.num_buckets - 1
    if index == last:  # every rank's updates first, so no rank's update waits on another's broadcast
        for bucket_index in range(last + 1):
            overlap.update(bucket_index)
        for bucket_index in range(last + 1):
            overlap.broadcast(bucket_index)
        overlap.finish_iteration()


def _one_bucket_behind(overlap: Overlap, index: int) -> None:
    if index > 0:
        overlap.update(index - 1)
        overlap.broadcast(index - 1)
    if index == overlap.num_buckets - 1:
        overlap.update(index)
        overlap.broadcast(index)
        overlap.finish_iteration()


def hook_with_zero_step(hook: Hook, ddp: Any, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> Hook:
    """Wrap ``hook`` so that, once the last bucket is handed over, every bucket is updated (after its
    all-reduce), then every bucket is broadcast, in bucket order (no rank's update waits on another's).

    ``shard_buckets=True`` splits each DDP bucket among ranks (about ``total / world_size`` elements
    each) instead of giving each bucket to one rank. The first two iterations only learn DDP's buckets.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=tp.optim.SGD, lr=0.1,
        ...                                overlap_with_ddp=True)
        >>> model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
        >>> for step in range(3):     # the first two iterations set up the buckets; then backward also steps
        ...     model(tp.randn(8, 16)).sum().backward()
        ...     zero.step()           # a no-op here: each bucket was stepped in backward
    """
    return _wrap("hook_with_zero_step", hook, ddp, zero, shard_buckets, _all_at_last_bucket)


def hook_with_zero_step_interleaved(hook: Hook, ddp: Any, zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False) -> Hook:
    """Wrap ``hook`` so that bucket ``i`` is updated and broadcast as soon as bucket ``i + 1`` is handed
    over (the last one right away), interleaving the updates with backward.

    Same arguments and warm-up as :func:`hook_with_zero_step`. The update runs on the backward
    thread (that keeps the collective order the same on every rank), so on CPU it pauses backward
    while it runs: there :func:`hook_with_zero_step` is usually faster.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step_interleaved
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=tp.optim.SGD, lr=0.1,
        ...                                overlap_with_ddp=True)
        >>> model.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, model, zero))
        >>> for step in range(3):     # after two set-up iterations, backward steps each bucket
        ...     model(tp.randn(8, 16)).sum().backward()
        ...     zero.step()           # a no-op here: each bucket was stepped in backward
    """
    return _wrap("hook_with_zero_step_interleaved", hook, ddp, zero, shard_buckets, _one_bucket_behind)
