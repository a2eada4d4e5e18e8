"""Read stored items into one reusable buffer and decode them from there (one read of the file, no page faults).

PyTorch's reader decodes each item straight from the file; ours must checksum the
bytes first, so it reads each item once into a buffer kept for the whole file,
checks it, and lets ``torch.load`` read from a view of that buffer.
"""

from __future__ import annotations

import io
from pathlib import Path

from tensorplay.distributed.checkpoint._staged_read import read_exactly

__all__ = ["ItemBuffer", "ViewReader"]


class ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview (``io.BytesIO`` would copy it)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: bytearray | memoryview) -> int:  # type: ignore[override]  # typeshed's Buffer: 3.12+
        n = max(0, min(len(target), len(self._view) - self._pos))
        memoryview(target).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class ItemBuffer:
    """One growing buffer; :meth:`read` fills it with an item's bytes and returns a view of them."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def read(self, fd: int, offset: int, length: int, path: Path) -> memoryview:
        if len(self._buffer) < length:
            self._buffer = bytearray(length)
        view = memoryview(self._buffer)[:length]
        read_exactly(fd, view, offset, path)
        return view
