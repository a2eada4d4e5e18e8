"""The pure math of the whole-matrix optimizer: regions, layouts, owners balanced by Newton-Schulz FLOPs."""

from __future__ import annotations

import pytest
import torch

from tensorplay.distributed.optim.matrix._layout import (
    MatrixLayout,
    assign_owners,
    flat_region,
    flat_shard_layout,
    newton_schulz_flops,
    replicated_layout,
)
from tensorplay.distributed.optim.matrix._sources import _local_block


def _coverage(layout: MatrixLayout) -> torch.Tensor:
    """How many senders hold each element of the whole tensor."""
    count = torch.zeros(layout.shape)
    for region, sends in zip(layout.holds, layout.sends, strict=True):
        if sends:
            region.of(count).add_(1)
    return count


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_flat_shards_cover_each_element_once(world: int) -> None:
    # Three tensors back to back in one flat buffer, padded; the middle one splits at odd offsets.
    shapes, offsets = [(3, 5), (7, 4), (2,)], [0, 15, 43]
    shard = -(-45 // world)
    for shape, offset in zip(shapes, offsets, strict=True):
        layout = flat_shard_layout(shape, offset, shard, world)
        assert torch.equal(_coverage(layout), torch.ones(shape)), (shape, world)
        whole = torch.arange(torch.Size(shape).numel()).view(shape)
        pieces = torch.cat([region.of(whole).reshape(-1) for region in layout.holds])
        assert torch.equal(pieces, whole.reshape(-1))   # rank order is element order


def test_replicated_layout_sends_once() -> None:
    layout = replicated_layout((4, 3), 3)
    assert layout.sends == (True, False, False)
    assert torch.equal(_coverage(layout), torch.ones(4, 3))


def test_flat_region_clamps_to_the_tensor() -> None:
    assert flat_region(10, -4, 3).sizes == (3,) and flat_region(10, -4, 3).starts == (0,)
    assert flat_region(10, 8, 20).sizes == (2,)
    assert flat_region(10, 12, 20).numel == 0


def test_local_block_of_shard_and_strided_shard() -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # 2-D mesh (2, 2): Shard(0) x Shard(1), uneven rows (5) and columns (3).
    assert _local_block((5, 3), (2, 2), [1, 1], (Shard(0), Shard(1)), "w") == ([3, 2], [2, 1])
    assert _local_block((5, 3), (2, 2), [0, 1], (Replicate(), Shard(1)), "w") == ([0, 2], [5, 1])
    # FSDP over column-wise TP: rows split by TP first, then each TP chunk by FSDP: one block per rank.
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    blocks = {(dp, tp_rank): _local_block((8, 3), (2, 2), [dp, tp_rank], placements, "w")
              for dp in range(2) for tp_rank in range(2)}
    assert blocks == {(0, 0): ([0, 0], [2, 3]), (1, 0): ([2, 0], [2, 3]),
                      (0, 1): ([4, 0], [2, 3]), (1, 1): ([6, 0], [2, 3])}
    with pytest.raises(NotImplementedError, match="not one block"):
        _local_block((8, 3), (2, 2), [0, 1], (Shard(0), _StridedShard(0, split_factor=2)), "w")


def _transformer_shapes(layers: int, dim: int) -> list[tuple[int, int]]:
    per_layer = [(3 * dim, dim), (dim, dim), (4 * dim, dim), (dim, 4 * dim)]
    return per_layer * layers   # Muon users give embeddings and the head to AdamW


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_owners_balance_newton_schulz_flops(world: int) -> None:
    shapes = _transformer_shapes(12, 768)
    costs = [newton_schulz_flops(shape, 5) for shape in shapes]
    owners = assign_owners(costs, world)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == rank) for rank in range(world)]
    assert max(loads) <= 1.3 * sum(costs) / world, loads
    assert sorted(set(owners)) == list(range(world))


def test_newton_schulz_flops_use_the_short_side() -> None:
    assert newton_schulz_flops((8, 2), 1) == newton_schulz_flops((2, 8), 1) == 2 * 4 * 8 + 2 * 8 + 2 * 4 * 8
    with pytest.raises(ValueError, match="world_size"):
        assign_owners([1], 0)


# ---- factored Adafactor: a piece as blocks of the (B, R, C) view; its partial sums ------------------------

def _piece_sums(shape: tuple[int, ...], grad: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """Every rank's row and column sums of its piece of ``grad`` squared (plus the norm slot), summed over ranks."""
    from tensorplay.distributed.optim.matrix._factored import FactoredPiece, _partial_sums, piece_blocks
    from tensorplay.distributed.optim.matrix._sources import MatrixSource

    total = None
    for rank, region in enumerate(layout.holds):
        piece = region.of(grad).clone().requires_grad_()
        piece.grad = piece.detach().clone()
        source = MatrixSource(piece, "w", None, layout)
        factored = FactoredPiece(source, rank, tuple(piece_blocks(shape, region)))
        _, buffer, _ = _partial_sums([(factored, {"maximize": False}, {})], torch.float32, torch.device("cpu"))
        total = buffer if total is None else total + buffer
    assert total is not None
    return total


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_factor_sums_of_flat_pieces_are_the_whole_tensors(world: int) -> None:
    # A batch of 3 matrices 5 x 7 at offset 4 of a flat buffer: pieces cut rows and matrices at odd places.
    shape = (3, 5, 7)
    layout = flat_shard_layout(shape, 4, -(-(105 + 6) // world), world)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(world))
    sums = _piece_sums(shape, grad, layout)
    rows, cols = grad.square().sum(-1).reshape(-1), grad.square().sum(-2).reshape(-1)
    torch.testing.assert_close(sums, torch.cat([rows, cols, grad.square().sum().view(1)]))


def test_flat_blocks_cover_the_range_in_order() -> None:
    from tensorplay.distributed.optim.matrix._factored import flat_blocks

    dims = (3, 5, 7)
    whole = torch.arange(105).view(dims)
    for start, end in [(0, 105), (4, 101), (6, 8), (35, 70), (33, 36), (40, 40)]:
        blocks = flat_blocks(dims, start, end)
        assert len(blocks) <= 5
        got = [whole[tuple(slice(s, s + z) for s, z in zip(starts, sizes, strict=True))].reshape(-1)
               for starts, sizes in blocks]
        assert torch.equal(torch.cat(got) if got else torch.zeros(0, dtype=torch.long), torch.arange(start, end))
