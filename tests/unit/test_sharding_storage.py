"""_sharding.storage: free a tensor's memory and re-allocate it, keeping the object and its views."""

from __future__ import annotations

import weakref

import torch

from tensorplay.distributed._sharding.storage import (
    BufferPool,
    _size_class,
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


CPU = torch.device("cpu")


def test_buffer_pool_reuses_given_buffers_and_bounds_them() -> None:
    pool = BufferPool(keep=1)
    first, second = pool.take(8, torch.float32, CPU), pool.take(8, torch.float32, CPU)
    pool.give(first)
    assert pool.take(8, torch.float32, CPU).data_ptr() == first.data_ptr()  # reused
    assert pool.take(8, torch.float32, CPU).data_ptr() not in (first.data_ptr(), second.data_ptr())  # not lent twice
    pool.give(first)
    pool.give(second)  # over ``keep``: dropped
    assert [b.data_ptr() for b in pool._idle[(8, torch.float32, CPU)]] == [first.data_ptr()]
    assert pool.take(8, torch.float64, CPU).dtype == torch.float64  # keyed by dtype


def test_buffer_pool_shares_a_size_class_between_close_sizes() -> None:
    pool = BufferPool()
    gathered = pool.take(1_049_600, torch.float32, CPU)  # an all-gather's output
    assert gathered.shape == (1_049_600,)
    pool.give(gathered.view(2, -1))  # a view at its start comes back as the buffer
    scattered = pool.take(1_049_604, torch.float32, CPU)  # a reduce-scatter input, 4 elements longer
    assert scattered.shape == (1_049_604,) and scattered.data_ptr() == gathered.data_ptr()
    assert _size_class(1_049_600) == _size_class(1_049_604) <= 1_049_600 * 33 // 32
    assert [_size_class(n) for n in (1, 63, 64, 65)] == [1, 63, 64, 66]


def test_buffer_pool_ignores_what_it_did_not_lend_and_second_returns() -> None:
    pool = BufferPool(keep=4)
    lent = pool.take(100, torch.float32, CPU)
    pool.give(torch.empty(100))  # not lent by this pool
    pool.give(lent)
    pool.give(lent)  # given back twice
    assert len(pool._idle[(100, torch.float32, CPU)]) == 1


def test_buffer_pool_holds_no_reference_to_what_it_lent() -> None:
    pool = BufferPool()
    buffer = pool.take(1 << 16, torch.float32, CPU)
    ref = weakref.ref(buffer._base)
    del buffer  # lost, never given back (a step that raised)
    assert ref() is None
