"""NO_SHARD units' small gradient all-reduces, bucketed across units.

[Note: bucketed NO_SHARD reduction]
A NO_SHARD unit's gradient is all-reduced whole over the replicas, as soon as
it is complete, so the all-reduce overlaps the rest of backward. For a small
gradient the all-reduce costs a round trip of every rank, not bytes: measured
on Gloo (2 and 4 ranks, 1 thread, loaded 2-core machine), sixteen 64 KiB
all-reduces took 5-10x one all-reduce of their concatenation, four 1 MiB ones
1.0x (2 ranks) and 1.7x (4 ranks) the concatenation's, copy included, while
eight 4 MiB ones took the same time as one of 32 MiB (the link's bytes, not
its round trips, are the cost there, and one big all-reduce at the end of
backward loses the overlap). So, as DDP does with its buckets, the root packs
the gradients of units under :data:`SMALL_GRAD_BYTES` into buckets and
all-reduces a bucket once all of its gradients are ready; larger gradients go
alone, without a copy.

At the first post-backward of an iteration the root plans buckets over the
units that reduce plainly (no communication hook, not sharded), in reverse
forward order, grouping consecutive small units with the same reduce dtype,
device, group and divide factors until a bucket holds :data:`BUCKET_BYTES`.
Each arriving gradient is copied (cast to the reduce dtype) into its unit's
slot of the bucket's buffer, allocated at the bucket's first gradient; the full
bucket is pre-divided and all-reduced asynchronously; once done it is
post-divided and each unit's gradient becomes a view of its slot (or is added
to a gradient kept from ``no_sync`` steps). End of backward launches any bucket
left partly filled (a unit without a gradient this iteration: its slot is zero).

Each element goes through the same arithmetic as the per-unit path (divide,
sum across ranks, divide), so at two ranks, where a sum of two is the same in
either order, the result is bitwise the per-unit one; at more ranks the order
of the sum depends on where the element falls in the collective's chunks, so
it may differ in the last bit (as DDP's does from per-parameter reductions).
A unit whose gradient arrives a second time in one backward (reentrant
checkpointing) is reduced on its own, as before.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ..._shard.collectives import all_reduce
from .flat_param import FlatParamHandle, GradReduction

#: A unit's gradient this large is all-reduced alone; smaller ones share buckets of about ``BUCKET_BYTES``.
SMALL_GRAD_BYTES = 1024 * 1024
BUCKET_BYTES = 4 * 1024 * 1024


@dataclass(eq=False)
class _Bucket:
    key: Hashable
    handles: list[FlatParamHandle] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    numel: int = 0
    nbytes: int = 0
    buffer: torch.Tensor | None = None
    filled: set[int] = field(default_factory=set)   # indices into ``handles`` whose gradient is in
    launched: bool = False

    def append(self, handle: FlatParamHandle, numel: int, nbytes: int) -> None:
        self.handles.append(handle)
        self.offsets.append(self.numel)
        self.numels.append(numel)
        self.numel += numel
        self.nbytes += nbytes

    def slot(self, index: int) -> torch.Tensor:
        assert self.buffer is not None
        start = self.offsets[index]
        return self.buffer[start:start + self.numels[index]]


class GradBuckets:
    """One backward's buckets (see [Note: bucketed NO_SHARD reduction]); ``handles`` in backward order."""

    def __init__(self, handles: list[FlatParamHandle]) -> None:
        self._buckets: list[_Bucket] = []
        self._where: dict[FlatParamHandle, tuple[_Bucket, int]] = {}
        bucket: _Bucket | None = None  # the one open to the next small unit
        for handle in handles:
            if handle in self._where:
                continue
            key, numel = handle.bucket_key(), handle.unsharded_numel
            nbytes = numel * handle.precision.reduce_dtype.itemsize
            if key is None or nbytes >= SMALL_GRAD_BYTES:
                bucket = None  # buckets hold consecutive units only
                continue
            if bucket is None or bucket.key != key or bucket.nbytes >= BUCKET_BYTES:
                bucket = _Bucket(key)
                self._buckets.append(bucket)
            self._where[handle] = (bucket, len(bucket.handles))
            bucket.append(handle, numel, nbytes)
        for bucket in self._buckets:  # a bucket of one unit: reduced alone, without the copy
            if len(bucket.handles) == 1:
                del self._where[bucket.handles[0]]
        self._buckets = [bucket for bucket in self._buckets if len(bucket.handles) > 1]

    def add(self, handle: FlatParamHandle, grad: torch.Tensor) -> GradReduction | None:
        """Take ``handle``'s unsharded gradient; its reduction, or the bucket's once full, or None (not yet)."""
        bucket, index = self._where.get(handle, (None, -1))
        if bucket is None or bucket.launched or index in bucket.filled:
            return handle.reduce_grad(grad)
        if bucket.buffer is None:
            bucket.buffer = grad.new_empty(bucket.numel, dtype=handle.precision.reduce_dtype)
        bucket.slot(index).copy_(grad)
        bucket.filled.add(index)
        return self._launch(bucket) if len(bucket.filled) == len(bucket.handles) else None

    def flush(self) -> list[GradReduction]:
        """Launch the buckets some but not all of whose gradients came (the end of backward)."""
        return [self._launch(bucket) for bucket in self._buckets if bucket.filled and not bucket.launched]

    def _launch(self, bucket: _Bucket) -> GradReduction:
        bucket.launched = True
        for index in range(len(bucket.handles)):
            if index not in bucket.filled:
                bucket.slot(index).zero_()
        buffer, first = bucket.buffer, bucket.handles[0]
        assert buffer is not None
        pre, post = first.plan.gradient_divide_factors()
        if pre > 1:
            buffer.div_(pre)
        where = first.bucket_name(bucket.handles[-1])
        pending = all_reduce(buffer, first.plan.replicate_group, async_op=True, where=where)

        def finish() -> None:
            if post > 1:
                buffer.div_(post)
            for index in sorted(bucket.filled):
                bucket.handles[index].accumulate_reduced(bucket.slot(index))

        return GradReduction(pending, finish)
