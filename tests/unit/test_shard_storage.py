"""_shard.storage: free a tensor's memory and re-allocate it, keeping the object and its views."""

from __future__ import annotations

import torch

from tensorplay.distributed._shard.storage import (
    BufferPool,
    alloc_storage,
    free_storage,
    is_allocated,
    storage_nbytes,
)


def test_free_then_alloc_keeps_object_and_views() -> None:
    buf = torch.arange(12, dtype=torch.float32)
    view = buf.view(3, 4)[1:]  # a view autograd might have saved
    free_storage(buf)
    assert buf.untyped_storage().size() == 0 and not is_allocated(buf)
    alloc_storage(buf)
    assert is_allocated(buf) and buf.untyped_storage().size() == 48
    buf.copy_(torch.arange(12, dtype=torch.float32) * 2)
    assert torch.equal(view, torch.arange(4, 12, dtype=torch.float32).view(2, 4) * 2)


def test_alloc_is_a_no_op_when_allocated() -> None:
    buf = torch.ones(5)
    ptr = buf.data_ptr()
    alloc_storage(buf)
    assert buf.data_ptr() == ptr and torch.equal(buf, torch.ones(5))


def test_nbytes_counts_the_storage_offset() -> None:
    base = torch.empty(10, dtype=torch.float64)
    assert storage_nbytes(base[2:6]) == 6 * 8
    assert storage_nbytes(base) == 80


def test_buffer_pool_reuses_given_buffers_and_bounds_them() -> None:
    pool = BufferPool(keep=1)
    first = pool.take(8, torch.float32, torch.device("cpu"))
    pool.give(first)
    assert pool.take(8, torch.float32, torch.device("cpu")) is first  # reused
    assert pool.take(8, torch.float32, torch.device("cpu")) is not first  # taken: not handed out twice
    other = torch.empty(8)
    pool.give(first)
    pool.give(other)  # over ``keep``: dropped
    assert pool.take(8, torch.float32, torch.device("cpu")) is first
    assert pool.take(8, torch.float64, torch.device("cpu")).dtype == torch.float64  # keyed by dtype
