"""ZeRO's ownership math: which rank updates which whole tensor.

Two pure rules, no process group:

* :func:`sorted_greedy_partition` packs the tensors of each parameter group,
  largest first, each onto the rank with the least elements so far. The loads
  carry over from one group to the next, so adding a group never moves the
  tensors of the earlier ones. Ties go to the lowest rank and equal sizes keep
  their input order, which is how PyTorch's ``ZeroRedundancyOptimizer`` breaks
  them, so both give the same partition.
* :func:`ddp_bucket_assignments` follows DDP's gradient buckets instead (for
  ``overlap_with_ddp``): a whole bucket per rank round-robin, or, with
  ``shard_buckets``, buckets cut at parameter boundaries into pieces of about
  ``total / world_size`` elements, smallest bucket first.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import overload


def least_loaded_rank(loads: Sequence[int], excluded: Collection[int] = ()) -> int:
    """The rank with the smallest load, skipping ``excluded``; ties go to the lowest rank."""
    candidates = [rank for rank in range(len(loads)) if rank not in excluded]
    if not candidates:
        raise ValueError(f"every rank of {len(loads)} is excluded; nothing left to assign to")
    return min(candidates, key=lambda rank: loads[rank])


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


class Ownership(Sequence[list[list[int]]]):
    """``owned[r][g]``: the indices (into group ``g``) that rank ``r`` owns, in packing order.

    Kept as one owner per tensor and listed for a rank when asked: memory grows with the tensors, not with the
    ranks (at 16,384 ranks, one list per rank and group was megabytes per rank for a few tensors).
    """

    def __init__(self, packed: list[list[tuple[int, int]]], world_size: int) -> None:
        self._packed = packed  # per group: (tensor index, owner rank), in packing order
        self._world_size = world_size

    def __len__(self) -> int:
        return self._world_size

    @overload
    def __getitem__(self, rank: int) -> list[list[int]]: ...

    @overload
    def __getitem__(self, rank: slice) -> list[list[list[int]]]: ...

    def __getitem__(self, rank: int | slice) -> list[list[int]] | list[list[list[int]]]:
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self._world_size))]
        if rank < 0:
            rank += self._world_size
        if not 0 <= rank < self._world_size:
            raise IndexError(f"rank {rank} out of range for {self._world_size} ranks")
        return [[index for index, owner in group if owner == rank] for group in self._packed]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def sorted_greedy_partition(group_numels: Sequence[Sequence[int]], world_size: int) -> Ownership:
    """Assign every tensor to one rank, group by group.

    ``group_numels[g][i]`` is the element count of tensor ``i`` of group ``g``.
    Returns ``owned[r][g]``: the indices (into group ``g``) that rank ``r``
    owns, in the order they were packed (largest first). The least-loaded rank
    comes from a heap: O(log W) per tensor.
    """
    _check_world_size(world_size)
    loads = [(0, rank) for rank in range(min(world_size, sum(len(numels) for numels in group_numels)))]
    # Ranks beyond the number of tensors never get one: (0, rank) for the lowest ranks is the whole heap needed.
    packed: list[list[tuple[int, int]]] = []
    for numels in group_numels:
        # sorted() is stable, so equal sizes keep their input order.
        largest_first = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
        group: list[tuple[int, int]] = []
        for index in largest_first:
            load, rank = heapq.heappop(loads)
            group.append((index, rank))
            heapq.heappush(loads, (load + numels[index], rank))
        packed.append(group)
    return Ownership(packed, world_size)


@dataclass(frozen=True)
class BucketAssignment:
    """Rank ``rank`` updates parameters ``[start, stop)`` of DDP bucket ``bucket_index``."""

    bucket_index: int
    start: int
    stop: int
    rank: int


def ddp_bucket_assignments(bucket_numels: Sequence[Sequence[int]], world_size: int,
                           shard_buckets: bool = False) -> list[BucketAssignment]:
    """Split DDP's gradient buckets among ranks, in the order the assignments are made.

    ``bucket_numels[b][i]`` is the element count of parameter ``i`` of bucket ``b``.
    Without ``shard_buckets`` bucket ``b`` goes whole to rank ``b % world_size``.
    With it, buckets are visited smallest first and cut before a parameter that
    would bring the current piece to ``total / world_size`` elements or more;
    each piece goes to the least-loaded rank that holds no other piece of the
    same bucket.
    """
    _check_world_size(world_size)
    for index, numels in enumerate(bucket_numels):
        if not numels:
            raise ValueError(f"DDP bucket {index} has no parameters")
    if not shard_buckets:
        return [BucketAssignment(b, 0, len(numels), b % world_size) for b, numels in enumerate(bucket_numels)]
    threshold = sum(map(sum, bucket_numels)) / world_size
    loads = [0] * world_size
    assignments: list[BucketAssignment] = []
    smallest_first = sorted(range(len(bucket_numels)), key=lambda b: sum(bucket_numels[b]))
    for bucket in smallest_first:
        taken: set[int] = set()
        for start, stop in _pieces(bucket_numels[bucket], threshold):
            rank = least_loaded_rank(loads, taken)
            taken.add(rank)
            loads[rank] += sum(bucket_numels[bucket][start:stop])
            assignments.append(BucketAssignment(bucket, start, stop, rank))
    return assignments


def _pieces(numels: Sequence[int], threshold: float) -> list[tuple[int, int]]:
    """Cut one bucket into ``[start, stop)`` runs, each closed before it would reach ``threshold``."""
    pieces: list[tuple[int, int]] = []
    start, size = 0, 0
    for index, numel in enumerate(numels):
        if index > start and size + numel >= threshold:
            pieces.append((start, index))
            start, size = index, 0
        size += numel
    pieces.append((start, len(numels)))
    return pieces
