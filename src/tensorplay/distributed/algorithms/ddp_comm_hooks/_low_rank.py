"""The pure math of PowerSGD: orthogonalisation, the compress-or-not rule, seeded random factors.

No process group here; :mod:`.powerSGD_hook` adds the communication. Every
function works on a *batch* of matrices (``B x n x r``), the layout both hooks
hand in (the single-matrix hook as a batch of one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__: list[str] = []


class CompressionCheck(NamedTuple):
    """Whether an ``n x m`` matrix is worth compressing, and its element counts before and after."""

    worth_it: bool
    uncompressed_numel: int
    compressed_numel: int


def should_compress(num_rows: int, num_cols: int, rank: int, min_compression_rate: float) -> CompressionCheck:
    """Compress when ``(n + m) * rank * min_compression_rate < n * m`` (the bandwidth saving pays for the work)."""
    uncompressed = num_rows * num_cols
    compressed = (num_rows + num_cols) * rank
    return CompressionCheck(compressed * min_compression_rate < uncompressed, uncompressed, compressed)


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each ``n x r`` matrix of the batch orthonormal, in place.

    Gram-Schmidt for ``r <= 2`` and for 16-bit dtypes (QR has no half kernel),
    QR otherwise. A column of zeros stays zeros (PyTorch's hook divides 0 by 0
    there when ``epsilon`` is 0 and every later gradient becomes NaN).
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(f"orthogonalize_ expects a batch of tall matrices (B x n x r with r <= n), "
                         f"got shape {tuple(matrices.shape)}")
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        _gram_schmidt_(matrices, epsilon)
    else:
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)


def _gram_schmidt_(matrices: torch.Tensor, epsilon: float) -> None:
    rank = matrices.shape[2]
    for i in range(rank):
        column = matrices[:, :, i:i + 1]
        norm = torch.norm(column, dim=1, keepdim=True)
        if epsilon == 0:
            norm = torch.where(norm == 0, torch.ones_like(norm), norm)  # 0 / 1 keeps a zero column zero
        else:
            norm = norm + epsilon
        column /= norm
        if i + 1 < rank:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column


def random_factors_(factors: list[torch.Tensor], seed: int) -> None:
    """Fill each factor with standard normals drawn on CPU from one generator seeded ``seed``, in order.

    Drawing on CPU makes the values independent of the device; a private
    generator leaves the global RNG (shared by thread ranks) untouched.
    """
    generator = torch.Generator().manual_seed(seed)
    for factor in factors:
        factor.copy_(torch.randn(*factor.shape, generator=generator, dtype=factor.dtype))
