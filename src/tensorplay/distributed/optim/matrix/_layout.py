"""Where each rank's piece of a sharded matrix lies in the whole matrix, and who updates which matrix.

Pure math (no collectives): a :class:`MatrixLayout` says, for every rank of the
matrix's shard group, which :class:`Region` of the whole tensor its local tensor
holds and whether it sends that piece to the matrix's owner (of several replicas
of the same piece only the first sends). :func:`assign_owners` spreads matrices
over ranks to balance the owners' work.

[Note: owner-per-matrix optimizer step]
Optimizers whose update of a matrix depends on the whole matrix (Muon's
Newton-Schulz orthogonalisation; any class we do not know) are run on whole
matrices (Adafactor, whose dependence is only through sums, takes the cheaper
[Note: factored Adafactor step] instead): each matrix has one owner
rank in its shard group, the pieces of its parameter and gradient travel to the
owner (one all-to-all for every matrix of the group), the owner runs the user's
optimizer class on the whole tensors, and the updated pieces travel back (a
second all-to-all). The arithmetic is the one-process optimizer's, so the result
is bitwise equal to single-process training; the work is divided by owners.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from tensorplay.distributed._sharding.partition import least_loaded_rank


@dataclass(frozen=True)
class Region:
    """A block of a whole tensor: the tensor viewed as ``view_shape``, then ``[starts, starts + sizes)`` per dim.

    A flat range of a classic FSDP flat parameter is the block ``[start, start + n)`` of the tensor viewed
    as ``(numel,)``; a DTensor shard is a block of the tensor in its own shape.
    """

    view_shape: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """The view of ``whole`` this region covers (not contiguous in general)."""
        view = whole.view(self.view_shape)
        for dim, (start, size) in enumerate(zip(self.starts, self.sizes, strict=True)):
            view = view.narrow(dim, start, size)
        return view


def flat_region(numel: int, start: int, end: int) -> Region:
    """Elements ``[start, end)`` of a tensor of ``numel`` elements, flattened (empty when ``end <= start``)."""
    start = min(max(start, 0), numel)
    return Region((numel,), (start,), (max(min(end, numel) - start, 0),))


def block_region(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Region:
    return Region(tuple(shape), tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class MatrixLayout:
    """How one parameter of ``shape`` is spread over the ranks of its shard group.

    ``holds[r]``: what group rank ``r``'s local tensor holds; ``sends[r]``: whether rank ``r`` sends it to the
    owner (False for a replica of a piece another rank sends).
    """

    shape: tuple[int, ...]
    holds: tuple[Region, ...]
    sends: tuple[bool, ...]

    @property
    def world_size(self) -> int:
        return len(self.holds)


def replicated_layout(shape: Sequence[int], world_size: int) -> MatrixLayout:
    """Every rank holds the whole tensor; rank 0 sends it."""
    whole = block_region(shape, [0] * len(shape), shape)
    return MatrixLayout(tuple(shape), (whole,) * world_size, tuple(rank == 0 for rank in range(world_size)))


def flat_shard_layout(shape: Sequence[int], offset: int, shard_numel: int, world_size: int) -> MatrixLayout:
    """A tensor at ``offset`` of a flat buffer split in chunks of ``shard_numel`` (classic FSDP)."""
    numel = prod(shape)
    holds = tuple(flat_region(numel, rank * shard_numel - offset, (rank + 1) * shard_numel - offset)
                  for rank in range(world_size))
    return MatrixLayout(tuple(shape), holds, (True,) * world_size)


def newton_schulz_flops(shape: Sequence[int], ns_steps: int) -> int:
    """Multiply-adds x2 of ``ns_steps`` quintic Newton-Schulz iterations on a matrix of ``shape``."""
    small, large = sorted(shape[-2:]) if len(shape) >= 2 else (1, prod(shape))
    per_step = 2 * small * small * large + 2 * small ** 3 + 2 * small * small * large
    return ns_steps * per_step


def step_cost(optimizer_class: type, shape: Sequence[int], options: Mapping[str, Any]) -> int:
    """One tensor's share of an optimizer step, to balance owners by: Newton-Schulz FLOPs for Muon (``options``
    give its ``ns_steps``), elements for the others."""
    if issubclass(optimizer_class, torch.optim.Muon) and len(shape) == 2:
        default = inspect.signature(torch.optim.Muon.__init__).parameters["ns_steps"].default
        return newton_schulz_flops(shape, int(options.get("ns_steps", default)))
    return prod(shape)


def assign_owners(costs: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each matrix: largest cost first, each to the least-loaded rank (ties: lowest index).

    Greedy longest-processing-time: the busiest rank ends within 4/3 of the optimum.
    """
    if world_size < 1:
        raise ValueError(f"assign_owners: world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = least_loaded_rank(loads)
        owners[index] = rank
        loads[rank] += costs[index]
    return owners
