"""Live tensor bytes during a region of code, and their peak: the tracker behind both sides of the estimate.

[Note: counting live tensor bytes]
A ``TorchDispatchMode`` sees every ATen op of the thread that runs inside it
(forward, the autograd engine's backward on the CPU and meta devices, optimizer
steps, our collectives' copies). An op's output whose storage is none of its
inputs' storages is a new allocation: its storage is recorded, with a
``weakref.finalize`` that drops it when the storage is freed (PyTorch keeps one
Python object per storage for as long as the storage lives). Storages alive
before the region are added with :meth:`LiveBytes.add` (a model's parameters,
an optimizer's state) or :meth:`LiveBytes.add_all_alive` (every tensor the
garbage collector can reach: the measured side). Sizes are read when counted,
so a storage resized in place (freed to 0 bytes and back) counts what it holds.

Not counted: tensors of other devices than the tracked one, storages mapped
from a file (the shared-memory transport's ``/dev/shm`` slots: shared pages,
not allocations), and what C++ allocates without an op (a collective
library's internal scratch). The peak is taken after each op, so a
temporary an op allocates and frees inside itself is not seen.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


def _plain_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors holding memory in ``tree``: a wrapper subclass (DTensor) by its inner tensors."""
    found: list[torch.Tensor] = []
    for leaf in tree_leaves(tree):
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            found.extend(_plain_tensors([getattr(leaf, name) for name in names]))
        else:
            found.append(leaf)
    return found


class LiveBytes(TorchDispatchMode):
    """Bytes of live storages on ``device`` (a type, e.g. ``"cpu"`` or ``"meta"``) while active; peak and where.

    ``where`` labels the current point of the step (the caller sets it: ``"forward blocks.0"``,
    ``"optimizer step"``); :attr:`peak_where` is the label current when the peak was reached.
    ``on_op`` (optional) is called with the live bytes after every op (the estimator's timeline).
    """

    def __init__(self, device: str | torch.device) -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0
        self.where = ""
        self.peak_where = ""
        self.timeline: list[tuple[int, str]] | None = None

    # ---- recording --------------------------------------------------------------------------------
    def add(self, tree: Any) -> None:
        """Count the storages of the tensors in ``tree`` (alive before the region) from now on."""
        for tensor in _plain_tensors(tree):
            self._record(tensor)

    def add_all_alive(self) -> None:
        """Count every storage on the device that a tensor the garbage collector tracks holds."""
        self.add([obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)])

    def _record(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._storages or storage.filename is not None:
            return
        self._storages[key] = weakref.ref(storage)
        weakref.finalize(storage, self._storages.pop, key, None)

    # ---- reading ----------------------------------------------------------------------------------
    @property
    def current(self) -> int:
        """Live bytes now; storages over the same memory (DLPack aliases, see ``own_storage_view``) count once."""
        spans = []
        for ref in list(self._storages.values()):
            storage = ref()
            if storage is not None and storage.nbytes():
                spans.append((storage.data_ptr(), storage.nbytes()))
        if self.device_type == "meta":  # no addresses: every storage is its own memory
            return sum(n for _, n in spans)
        total, reach = 0, 0
        for start, nbytes in sorted(spans):
            end = start + nbytes
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total

    def note(self, where: str | None = None) -> int:
        """Take the current bytes into the peak (labelled ``where``, or the current label); returns them."""
        live = self.current
        if where is not None:
            self.where = where
        if live > self.peak:
            self.peak, self.peak_where = live, self.where
        if self.timeline is not None:
            self.timeline.append((live, self.where))
        return live

    def reset_peak(self) -> None:
        self.peak, self.peak_where = self.current, self.where

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in _plain_tensors((args, kwargs))}
        for tensor in _plain_tensors(out):
            if id(tensor.untyped_storage()) not in inputs:
                self._record(tensor)
        self.note()
        return out

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """Stop counting the storages of ``tensors`` (the estimator drops gradients it accounts for itself)."""
        for tensor in _plain_tensors(list(tensors)):
            self._storages.pop(id(tensor.untyped_storage()), None)
