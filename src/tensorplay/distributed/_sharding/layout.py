"""Pure sharding math: chunk sizes, padding, rank slices, flat layouts.

No process group here: everything is a function of sizes, world size and rank,
so it is tested in one process and shared by every front end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def chunk_size(length: int, world_size: int) -> int:
    """Rows (or elements) each rank holds when ``length`` is split ``world_size`` ways, padded."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return ceil_div(length, world_size)


def padded_length(length: int, world_size: int) -> int:
    return chunk_size(length, world_size) * world_size


@dataclass(frozen=True)
class RankSlice:
    """Rank ``rank``'s part of a dimension of ``length``: ``[start, start + size)`` of real data.

    ``padding`` zeros follow it so every rank's chunk has ``chunk`` rows.
    """

    start: int
    size: int
    chunk: int

    @property
    def padding(self) -> int:
        return self.chunk - self.size


def rank_slice(length: int, world_size: int, rank: int) -> RankSlice:
    """The slice of ``length`` owned by ``rank`` under even chunking with trailing padding."""
    chunk = chunk_size(length, world_size)
    start = min(rank * chunk, length)
    return RankSlice(start=start, size=min(chunk, length - start), chunk=chunk)


@dataclass(frozen=True)
class FlatLayout:
    """Tensors laid end to end in one 1D buffer, padded to split evenly across ranks.

    ``offsets[i]`` is where tensor ``i`` starts; ``shard_numel`` is each rank's
    share of the padded buffer.
    """

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    world_size: int

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.numels else 0

    @property
    def padded_numel(self) -> int:
        return padded_length(self.numel, self.world_size)

    @property
    def shard_numel(self) -> int:
        return chunk_size(self.numel, self.world_size)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view into a 1D ``flat`` buffer of at least ``numel`` elements."""
        return [flat[offset: offset + numel].view(shape)
                for offset, numel, shape in zip(self.offsets, self.numels, self.shapes, strict=True)]


def flat_layout(shapes: Sequence[torch.Size | Sequence[int]], world_size: int) -> FlatLayout:
    """Lay out tensors of ``shapes`` back to back (no gaps between them)."""
    offsets, numels, cursor = [], [], 0
    for shape in shapes:
        numel = prod(shape)
        offsets.append(cursor)
        numels.append(numel)
        cursor += numel
    return FlatLayout(tuple(torch.Size(s) for s in shapes), tuple(offsets), tuple(numels), world_size)
