"""NO_SHARD units' gradient all-reduces, in buckets that persist across iterations.

[Note: bucketed NO_SHARD reduction]
A NO_SHARD unit's gradient is all-reduced whole over the replicas, as soon as
it is complete, so the all-reduce overlaps the rest of backward. For a small
gradient the all-reduce costs a round trip of every rank, not bytes: measured
on Gloo (2 and 4 ranks, 1 thread, loaded 2-core machine), sixteen 64 KiB
all-reduces took 5-10x one all-reduce of their concatenation, four 1 MiB ones
1.0x (2 ranks) and 1.7x (4 ranks) the concatenation's, copy included. So, as
DDP does with its buckets, the root groups the units' gradients into buckets
and all-reduces a bucket once all of its gradients are ready.

At the first post-backward (or gradient) of an iteration the root plans buckets
over the units that reduce plainly (no communication hook, not sharded), in
reverse forward order, grouping consecutive units with the same bucket key
(reduce dtype, device, group, divide factors, whether the gradient is written in
place) until a bucket holds its cap. The plan and the buckets' buffers are kept
for the next iterations while the units and their keys stay the same.

Two kinds of unit:

* In place (NO_SHARD at full precision, see [Note: gradients from the views]
  in ``flat_param``): backward writes the unit's gradient straight into its slot
  of the bucket's buffer, so a bucket costs no copy, whatever its units' sizes
  (as DDP's ``gradient_as_bucket_view`` buckets). A bucket closes once it holds
  :data:`BUCKET_BYTES`: on one host the all-reduce goes through shared memory,
  whose slots all count in every rank's RSS (see ``_comm/host_memory``): with
  16 MiB buckets that was +56 MiB per rank at 2 ranks and +122 at 4 (issue
  model: 8 units of 4 MiB), with 4 MiB +16 and +32, and the step was faster
  too (0.69x and 0.84x DDP's against 0.90x and 0.99x). Since the all-reduce
  goes in pieces of at most 4 MiB of rows, the slots take 5-8 MiB.
* Otherwise (mixed precision, CPU offload): the gradient is copied (cast to the
  reduce dtype) into its slot, which pays off for small gradients only: units
  from :data:`SMALL_GRAD_BYTES` on are reduced alone, without the copy, and a
  copying bucket holds up to :data:`COPY_BUCKET_BYTES`.

The full bucket is pre-divided (a gradient written in place was divided on its
way in, in the same pass) and all-reduced asynchronously; once done it is
post-divided and each unit's gradient becomes a view of its slot (or is added
to a gradient kept from ``no_sync`` steps). End of backward launches any bucket
left partly filled (a unit without a gradient this iteration: its slot is zero).

[Note: reusing a bucket's buffer] The optimizer gets views of the buffer as
gradients; ``zero_grad()`` (set to None) drops them. At a bucket's first
gradient of an iteration the buffer is reused when nothing but the bucket
refers to its memory (no gradient, view or alias of it is alive: the storage's
use count); otherwise (gradients kept with ``zero_grad(set_to_none=False)``, or
held by the user) the bucket takes a new buffer and the old one stays theirs.
Reusing the memory spares the page faults of a fresh multi-MiB buffer per
iteration on the CPU (see [Note: reuse collective buffers on the CPU] in
``_sharding/storage``).

The in-place buckets of one dtype and device share one buffer, allocated at
once, each a view of its part for the iteration (the views are dropped at its
end, so the use count still tells whether anything else holds it); at the
first in-place gradient of an iteration it is reused or renewed as a whole.
Allocated bucket by bucket between backward's own temporaries, the kept buffers
fragmented the heap: the default allocator's peak RSS, NO_SHARD at 4 ranks, was
483-492 MiB (issue model) and 667-710 (mlp20m, median 698) per rank over runs,
against 476-485 and 667-672 allocated at once (PyTorch's FSDP: 486-496 and
670-720; live memory unchanged).

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

from ..._comm.collectives import FlatParts, all_reduce
from ..._sharding.storage import shares_memory_elsewhere
from .flat_param import FlatParamHandle, GradReduction

#: Gradients written in place share buckets until one holds this many bytes (each unit in one bucket whole).
BUCKET_BYTES = 4 * 1024 * 1024
#: Copied gradients: from this size on a unit is all-reduced alone; smaller ones share buckets of ``COPY_BUCKET_BYTES``.
SMALL_GRAD_BYTES = 1024 * 1024
COPY_BUCKET_BYTES = 4 * 1024 * 1024


@dataclass(eq=False)
class _Bucket:
    key: Hashable
    cap: int
    handles: list[FlatParamHandle] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    numel: int = 0
    nbytes: int = 0
    in_place: bool = False               # its first unit writes its gradient into the slot itself
    #: copying buckets: kept across iterations; in-place ones: a view of the shared buffer for this iteration
    #: (see [Note: reusing a bucket's buffer])
    buffer: torch.Tensor | None = None
    # this iteration's progress:
    ready: bool = False                  # copying buckets: ``buffer`` was checked (renewed if shared) this iteration
    filled: set[int] = field(default_factory=set)   # indices into ``handles`` whose gradient is in
    divided: set[int] = field(default_factory=set)  # ... and already divided by the pre-divide factor
    launched: bool = False

    def takes(self, key: Hashable) -> bool:
        """Whether the next unit (with ``key``) joins this bucket: same key, cap not yet reached."""
        return key == self.key and self.nbytes < self.cap

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

    @property
    def kind(self) -> tuple[torch.dtype, torch.device]:
        first = self.handles[0]
        return first.precision.reduce_dtype, first.grad_device

    def release_stale_grads(self) -> None:
        for handle in self.handles:
            handle.release_stale_grad()

    def prepare(self) -> None:
        """A copying bucket's first gradient of an iteration: a buffer nobody else holds."""
        if self.ready:
            return
        self.ready = True
        self.release_stale_grads()
        if self.buffer is None or shares_memory_elsewhere(self.buffer):
            dtype, device = self.kind
            self.buffer = torch.empty(self.numel, dtype=dtype, device=device)

    def end_iteration(self) -> None:
        self.ready, self.launched = False, False
        if self.in_place:
            self.buffer = None  # a view of the shared buffer: held, it would count as a use of it
        self.filled.clear()
        self.divided.clear()


class GradBuckets:
    """The root's buckets (see [Note: bucketed NO_SHARD reduction]); ``handles`` in backward order."""

    def __init__(self, handles: list[FlatParamHandle]) -> None:
        self.signature = self.signature_of(handles)
        self._buckets: list[_Bucket] = []
        self._shared: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # the in-place buckets' memory
        self._placed = False  # this iteration's in-place buckets have their views of it
        self._where: dict[FlatParamHandle, tuple[_Bucket, int]] = {}
        bucket: _Bucket | None = None  # the one open to the next unit
        for handle in handles:
            if handle in self._where:
                continue
            key, numel = handle.bucket_key(), handle.unsharded_numel
            nbytes = numel * handle.precision.reduce_dtype.itemsize
            in_place = handle.writes_grad_in_place
            if key is None or (not in_place and nbytes >= SMALL_GRAD_BYTES):
                bucket = None  # buckets hold consecutive units only
                continue
            if bucket is None or not bucket.takes(key):
                bucket = _Bucket(key, BUCKET_BYTES if in_place else COPY_BUCKET_BYTES, in_place=in_place)
                self._buckets.append(bucket)
            self._where[handle] = (bucket, len(bucket.handles))
            bucket.append(handle, numel, nbytes)
        for bucket in self._buckets:  # a copying bucket of one unit: reduced alone, without the copy
            if len(bucket.handles) == 1 and not bucket.handles[0].writes_grad_in_place:
                del self._where[bucket.handles[0]]
        self._buckets = [bucket for bucket in self._buckets if bucket.handles[0] in self._where]

    @staticmethod
    def signature_of(handles: list[FlatParamHandle]) -> tuple:
        """What the plan depends on: a plan is reused while this stays the same."""
        return tuple((handle, handle.bucket_key()) for handle in handles)

    def target(self, handle: FlatParamHandle) -> tuple[torch.Tensor, float] | None:
        """Where ``handle``'s gradient may be written in place: its slot, if it has one this iteration, and the
        pre-divide factor to write it divided by (fused with the copy; :meth:`add` then takes it as divided)."""
        bucket, index = self._where.get(handle, (None, -1))
        if bucket is None or bucket.launched or index in bucket.filled or not handle.writes_grad_in_place:
            return None
        self._prepare(bucket)
        return bucket.slot(index), handle.plan.gradient_divide_factors()[0]

    def add(self, handle: FlatParamHandle, grad: torch.Tensor | FlatParts) -> GradReduction | None:
        """Take ``handle``'s unsharded gradient; its reduction, or the bucket's once full, or None (not yet)."""
        bucket, index = self._where.get(handle, (None, -1))
        if bucket is None or bucket.launched or index in bucket.filled:
            return handle.reduce_grad(grad)
        assert isinstance(grad, torch.Tensor)  # bucketed units are unsharded: their gradient is a tensor
        self._prepare(bucket)
        slot = bucket.slot(index)
        if grad.data_ptr() == slot.data_ptr():  # written in place, divided (see ``target``)
            bucket.divided.add(index)
        else:
            slot.copy_(grad)
        bucket.filled.add(index)
        return self._launch(bucket) if len(bucket.filled) == len(bucket.handles) else None

    def flush(self) -> list[GradReduction]:
        """Launch the buckets some but not all of whose gradients came (the end of backward)."""
        return [self._launch(bucket) for bucket in self._buckets if bucket.filled and not bucket.launched]

    def end_iteration(self) -> None:
        """After every reduction of the iteration finished: the buffers stay for the next one."""
        for bucket in self._buckets:
            bucket.end_iteration()
        self._placed = False

    def _prepare(self, bucket: _Bucket) -> None:
        if bucket.in_place:
            self._place_in_place_buckets()
        else:
            bucket.prepare()

    def _place_in_place_buckets(self) -> None:
        """At the iteration's first in-place gradient: each in-place bucket's view of its shared buffer, which is
        renewed when something else still holds it (see [Note: reusing a bucket's buffer])."""
        if self._placed:
            return
        self._placed = True
        by_kind: dict[tuple[torch.dtype, torch.device], list[_Bucket]] = {}
        for bucket in self._buckets:
            if bucket.in_place:
                bucket.release_stale_grads()
                by_kind.setdefault(bucket.kind, []).append(bucket)
        for (dtype, device), buckets in by_kind.items():
            shared = self._shared.get((dtype, device))
            if shared is None or shares_memory_elsewhere(shared):
                shared = self._shared[(dtype, device)] = torch.empty(sum(b.numel for b in buckets), dtype=dtype,
                                                                     device=device)
            start = 0
            for bucket in buckets:
                bucket.buffer = shared[start:start + bucket.numel]
                start += bucket.numel

    def _launch(self, bucket: _Bucket) -> GradReduction:
        bucket.launched = True
        for index in range(len(bucket.handles)):
            if index not in bucket.filled:
                bucket.slot(index).zero_()
        buffer, first = bucket.buffer, bucket.handles[0]
        assert buffer is not None
        pre, post = first.plan.gradient_divide_factors()
        if pre > 1 and bucket.divided != bucket.filled:
            for index in bucket.filled - bucket.divided:
                bucket.slot(index).div_(pre)
        where = first.bucket_name(bucket.handles[-1])
        pending = all_reduce(buffer, first.plan.replicate_group, async_op=True, where=where)
        filled = sorted(bucket.filled)

        def finish() -> None:
            if post > 1:
                buffer.div_(post)
            for index in filled:
                start = bucket.offsets[index]
                bucket.handles[index].accumulate_reduced(buffer[start:start + bucket.numels[index]])

        return GradReduction(pending, finish)
