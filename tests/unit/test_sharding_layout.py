"""Pure sharding math of tensorplay.distributed._sharding.layout (no processes)."""

from __future__ import annotations

import pytest
import torch

from tensorplay.distributed._sharding import layout


@pytest.mark.parametrize("length,world", [(10, 4), (8, 2), (3, 4), (1, 3), (0, 2)])
def test_rank_slices_tile_the_dimension_like_torch_chunk(length, world):
    slices = [layout.rank_slice(length, world, r) for r in range(world)]
    expected = list(torch.arange(length).chunk(world)) if length else []
    for r, s in enumerate(slices):
        assert s.chunk == layout.chunk_size(length, world)
        assert s.size + s.padding == s.chunk
        got = torch.arange(length)[s.start: s.start + s.size]
        want = expected[r] if r < len(expected) else torch.arange(0)
        assert torch.equal(got, want)
    assert sum(s.size for s in slices) == length


def test_flat_layout_offsets_padding_and_views():
    shapes = [(3, 2), (5,), (2, 2)]
    flat = layout.flat_layout(shapes, world_size=4)
    assert flat.offsets == (0, 6, 11) and flat.numel == 15
    assert flat.padded_numel == 16 and flat.shard_numel == 4
    assert flat.shard_range(3) == (12, 16)
    buffer = torch.arange(16.0)
    views = flat.views(buffer)
    assert [v.shape for v in views] == [torch.Size(s) for s in shapes]
    assert views[1].data_ptr() == buffer[6:].data_ptr()


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        layout.chunk_size(4, 0)
