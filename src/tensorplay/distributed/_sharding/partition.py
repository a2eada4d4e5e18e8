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

from collections.abc import Collection, Sequence
from dataclasses import dataclass


def least_loaded_rank(loads: Sequence[int], excluded: Collection[int] = ()) -> int:
    """The rank with the smallest load, skipping ``excluded``; ties go to the lowest rank."""
    candidates = [rank for rank in range(len(loads)) if rank not in excluded]
    if not candidates:
        raise ValueError(f"every rank of {len(loads)} is excluded; nothing left to assign to")
    return min(candidates, key=lambda rank: loads[rank])


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def sorted_greedy_partition(group_numels: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """Assign every tensor to one rank, group by group.

    ``group_numels[g][i]`` is the element count of tensor ``i`` of group ``g``.
    Returns ``owned[r][g]``: the indices (into group ``g``) that rank ``r``
    owns, in the order they were packed (largest first).
    """
    _check_world_size(world_size)
    owned: list[list[list[int]]] = [[[] for _ in group_numels] for _ in range(world_size)]
    loads = [0] * world_size
    for group_index, numels in enumerate(group_numels):
        # sorted() is stable, so equal sizes keep their input order.
        largest_first = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
        for index in largest_first:
            rank = least_loaded_rank(loads)
            owned[rank][group_index].append(index)
            loads[rank] += numels[index]
    return owned


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
