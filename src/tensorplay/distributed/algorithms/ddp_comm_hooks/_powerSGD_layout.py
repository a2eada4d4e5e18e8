"""How :func:`powerSGD_hook` splits one bucket: matrices to compress (batched by shape) and the rest.

Pure bookkeeping over the bucket's gradient views; no communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._low_rank import should_compress

__all__: list[str] = []


@dataclass
class BucketLayout:
    """One bucket's plan for an iteration.

    ``batches[i]`` is a ``B x n x m`` batch of gradient matrices: a view into
    the bucket when ``B == 1``, else a stacked copy whose rows are written back
    to ``stacked_from[i]`` by :meth:`copy_back_batches`. Factors ``P`` (``B x n x
    r``) and ``Q`` (``B x m x r``) of all batches live in two flat buffers, in
    batch order.
    """

    batches: list[torch.Tensor] = field(default_factory=list)
    stacked_from: list[list[torch.Tensor]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    uncompressed: list[torch.Tensor] = field(default_factory=list)
    numel_before: int = 0
    numel_after: int = 0

    @property
    def p_numel(self) -> int:
        return sum(b.shape[0] * b.shape[1] * r for b, r in zip(self.batches, self.ranks, strict=True))

    @property
    def q_numel(self) -> int:
        return sum(b.shape[0] * b.shape[2] * r for b, r in zip(self.batches, self.ranks, strict=True))

    def factor_views(self, p_memory: torch.Tensor,
                     q_memory: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per batch, its ``P`` and ``Q`` as views into the flat memories."""
        ps, qs = [], []
        p_at = q_at = 0
        for batch, rank in zip(self.batches, self.ranks, strict=True):
            size, n, m = batch.shape
            ps.append(p_memory[p_at:p_at + size * n * rank].view(size, n, rank))
            qs.append(q_memory[q_at:q_at + size * m * rank].view(size, m, rank))
            p_at += size * n * rank
            q_at += size * m * rank
        return ps, qs

    def flat_uncompressed(self, like: torch.Tensor) -> torch.Tensor:
        """The uncompressed gradients concatenated into one new flat tensor (empty when there are none)."""
        if not self.uncompressed:
            return like.new_empty(0)
        return torch.cat([t.reshape(-1) for t in self.uncompressed])

    def unpack_uncompressed(self, flat: torch.Tensor) -> None:
        at = 0
        for tensor in self.uncompressed:
            tensor.copy_(flat[at:at + tensor.numel()].view_as(tensor))
            at += tensor.numel()

    def copy_back_batches(self) -> None:
        for batch, originals in zip(self.batches, self.stacked_from, strict=True):
            if not originals:
                continue  # a view: decompressed in place
            for row, original in zip(batch, originals, strict=True):
                original.copy_(row)


def plan_layout(gradients: list[torch.Tensor], rank: int, min_compression_rate: float,
                batch_same_shape: bool) -> BucketLayout:
    """Split ``gradients`` (views into a bucket) into matrices worth compressing and the rest.

    A gradient of shape ``(n, ...)`` is the matrix ``n x (numel / n)``; vectors
    and 0-d tensors never gain from compression. Matrices are grouped by shape
    in order of first appearance (the order factors are drawn and laid out in);
    with ``batch_same_shape`` each group is one batch, else each matrix is its own.
    """
    layout = BucketLayout()
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    for gradient in gradients:
        if gradient.dim() == 0:
            layout.uncompressed.append(gradient)
            layout.numel_before += 1
            layout.numel_after += 1
            continue
        matrix = gradient.view(gradient.shape[0], -1)
        n, m = matrix.shape
        check = should_compress(n, m, min(n, m, rank), min_compression_rate)
        layout.numel_before += check.uncompressed_numel
        if check.worth_it:
            by_shape.setdefault(matrix.shape, []).append(matrix)
            layout.numel_after += check.compressed_numel
        else:
            layout.uncompressed.append(gradient)
            layout.numel_after += check.uncompressed_numel
    for (n, m), matrices in by_shape.items():
        if batch_same_shape and len(matrices) > 1:
            _add_batch(layout, torch.stack(matrices), matrices, min(n, m, rank))
        else:
            for matrix in matrices:
                _add_batch(layout, matrix.unsqueeze(0), [], min(n, m, rank))
    return layout


def _add_batch(layout: BucketLayout, batch: torch.Tensor, stacked_from: list[torch.Tensor], rank: int) -> None:
    layout.batches.append(batch)
    layout.stacked_from.append(stacked_from)
    layout.ranks.append(rank)
