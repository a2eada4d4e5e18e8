"""The data split of a job that can lose ranks: each rank's share is a function of (step, rank, world size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sampler"]


@dataclass(frozen=True)
class Sampler:
    """Global batch ``step`` is samples ``step * global_batch ...`` (mod ``dataset_size``), cut into ``world``
    contiguous shares in rank order. The global batch does not depend on the world size: when a rank is lost
    its samples go to the survivors, and a loss normalised by the global batch (:meth:`weight`) keeps the
    same curve."""

    global_batch: int
    dataset_size: int

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"Sampler: global_batch must be >= 1, got {self.global_batch}")
        if self.dataset_size < 1:
            raise ValueError(f"Sampler: dataset_size must be >= 1, got {self.dataset_size}")

    def check_world(self, world: int) -> None:
        """Raise unless every one of ``world`` ranks gets at least one sample."""
        if world > self.global_batch:
            raise ValueError(f"Sampler: global_batch {self.global_batch} is smaller than the world size {world}: "
                             "a rank would get no samples; use a global batch of at least the world size")

    def share(self, rank: int, world: int) -> tuple[int, int]:
        """``[begin, end)`` of ``rank``'s share within a global batch."""
        return rank * self.global_batch // world, (rank + 1) * self.global_batch // world

    def indices(self, step: int, rank: int, world: int) -> torch.Tensor:
        """The dataset indices of ``rank``'s share of global batch ``step`` (int64, 1-D)."""
        begin, end = self.share(rank, world)
        return (torch.arange(begin, end) + step * self.global_batch) % self.dataset_size

    def weight(self, rank: int, world: int) -> float:
        """What a mean loss over ``rank``'s share is multiplied by so that the gradients, averaged over the
        ranks (as DDP and the sharded front ends do), are those of the mean over the global batch (1.0 when
        ``world`` divides the global batch)."""
        begin, end = self.share(rank, world)
        return (end - begin) * world / self.global_batch
