"""Free a tensor's memory and bring it back later, keeping the tensor object (and its views) alive.

[Note: free and re-allocate storage]
Autograd saves the unsharded parameters a forward used and reads the same
tensor objects in backward. To drop their memory between forward and backward
without breaking those references, the tensor's storage is resized to zero
bytes (:func:`free_storage`); before the next all-gather writes into it, the
storage is resized back to the bytes the tensor spans (:func:`alloc_storage`),
uninitialized. Every view of the tensor sees the re-gathered data. The tensor
must be contiguous from its storage offset (a buffer made by ``torch.empty``,
or a view at its start).
"""

from __future__ import annotations

import torch


def storage_nbytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor``'s storage needs to hold it (contiguous, from its storage offset)."""
    return int(tensor.storage_offset() + tensor.numel()) * tensor.element_size()


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory; the tensor object stays valid until :func:`alloc_storage`."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Re-allocate ``tensor``'s memory (uninitialized) if :func:`free_storage` released it."""
    storage, nbytes = tensor.untyped_storage(), storage_nbytes(tensor)
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def own_storage_view(view: torch.Tensor) -> torch.Tensor:
    """``view``'s memory as a tensor with a storage of its own (offset 0), keeping ``view``'s storage alive.

    [Note: a parameter's own storage]
    fully_shard keeps a group's shards back to back in one flat buffer, so each
    sharded parameter is a view at some offset of it. PyTorch's DTensor copies
    its local tensor's storage offset onto itself, and ``torch.save`` of a DTensor
    with a non-zero offset then fails ("invalid python storage"): ``torch.save``
    of a fully_shard state dict would break. A DLPack round trip gives the view a
    storage of its own over the same bytes (writes through either are seen by
    both; the new storage holds a reference to the old), on any device that has
    DLPack. The meta device has none: its views are returned as they are.
    """
    if view.device.type == "meta":
        return view
    return torch.from_dlpack(view.detach())


def shares_memory_elsewhere(tensor: torch.Tensor) -> bool:
    """Whether another tensor (a view, a ``.data`` alias, a gradient made of it) uses ``tensor``'s storage.

    For a buffer its owner never hands out itself, only views of: False means no
    view is alive any more, so the buffer may be overwritten.
    """
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) > _OWN_STORAGE_REFS


def is_allocated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage currently holds its bytes."""
    return tensor.untyped_storage().size() >= storage_nbytes(tensor)


class BufferPool:
    """Scratch buffers for collectives, reused across groups and steps instead of freshly allocated.

    [Note: reuse collective buffers on the CPU]
    A fresh CPU buffer of several MiB costs its page faults on first touch
    (measured: allocating and filling 8 MiB takes about twice as long as
    filling a reused one), every all-gather and reduce-scatter of every step.
    Buffers are allocated in size classes (rounded up by at most 1/32), so an
    all-gather's output and a slightly larger reduce-scatter input share one
    class (one buffer serves both: fewer idle next to the step's own peak);
    :meth:`take` hands out a view of the requested length. At most ``keep``
    buffers per class stay idle, and the pool holds no reference to the ones it
    lent: a buffer never given back (a step that raised) is simply freed.
    Accelerators' caching allocators already reuse memory (and track streams),
    so there the pool allocates plainly and keeps nothing. One pool per
    fully_shard root: no process-global state.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._idle: dict[_PoolKey, list[torch.Tensor]] = {}
        self._lent: dict[int, _PoolKey] = {}  # data_ptr of each lent buffer -> its class (no reference held)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D buffer of ``numel`` elements, uninitialized (a reused one when one is idle)."""
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if device.type != "cpu" or numel == 0:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (_size_class(numel), dtype, device)
        idle = self._idle.get(key)
        whole = idle.pop() if idle else torch.empty(key[0], dtype=dtype, device=device)
        self._lent[whole.data_ptr()] = key
        return whole[:numel]

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from :meth:`take` (or a view at its start) that nothing reads or writes any more."""
        key = self._lent.pop(buffer.data_ptr(), None) if buffer.device.type == "cpu" else None
        if key is None:  # not lent by this pool, or given back already
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.keep:
            idle.append(buffer if buffer._base is None else buffer._base)

    def clear(self) -> None:
        """Drop every idle buffer."""
        self._idle.clear()


_PoolKey = tuple[int, torch.dtype, torch.device]


def _size_class(numel: int) -> int:
    """``numel`` rounded up to a multiple of 1/32 of its highest power of two (at most 1/32 more)."""
    step = max(1, 1 << max(numel.bit_length() - 6, 0))
    return -(-numel // step) * step


def _own_storage_refs() -> int:
    lone = torch.empty(1)
    return torch._C._storage_Use_Count(lone.untyped_storage()._cdata)


#: A lone tensor's storage use count as :func:`shares_memory_elsewhere` reads it (the tensor and the reading).
_OWN_STORAGE_REFS = _own_storage_refs()
