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


def is_allocated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage currently holds its bytes."""
    return tensor.untyped_storage().size() >= storage_nbytes(tensor)
