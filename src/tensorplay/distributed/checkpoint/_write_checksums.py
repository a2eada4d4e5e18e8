"""CRC-32 of each stored item computed while DCP writes it, so a save never reads its files back.

[Note: checksums on the write path]
DCP's writer calls ``stream.tell()`` right before and right after it writes each
item, and ``torch.save`` into a stream only ever calls ``write`` (checked on
PyTorch 2.13). So the bytes between two ``tell()`` calls are exactly one item:
:class:`ChecksummingStream` keeps a running CRC-32 over ``write`` and closes a
segment at every ``tell()``. An item whose range matches no segment (another
writer, a transform extension) is checksummed by reading it back instead.

A large ``write`` is not checksummed at once: ``torch.save`` writes each zip
record's data, then a data descriptor holding the record's CRC-32 (which it has
just computed). When the next write is that descriptor, with the same length,
its CRC is folded into the running one (see [Note: CRC-32 without a second
pass] in ``tensorplay._crc32``); otherwise (PyTorch's CRCs switched off with
``torch.serialization.set_crc32_options(False)``, another layout) the data is
read back from the file and checksummed, so a CRC is never taken on trust from
anything but the descriptor of the record just written.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from tensorplay._crc32 import crc32, crc32_combine
from tensorplay.distributed.checkpoint._manifest import crc32_ranges

__all__ = ["ChecksummingFileSystem", "ChecksummingStream"]


#: Writes at least this large wait for the zip data descriptor that follows them.
_DEFER_BYTES = 1 << 20
_DESCRIPTOR = b"PK\x07\x08"


class ChecksummingStream:
    """A binary file opened for writing that records ``{(offset, length): crc32}`` between ``tell()`` calls."""

    def __init__(self, raw: IO[bytes], segments: dict[tuple[int, int], int]) -> None:
        self._raw = raw
        self._segments = segments
        self._start = raw.tell()
        self._crc = 0
        self._pending: tuple[int, int] | None = None  # (offset, length) of a large write not yet checksummed

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._pending is not None:
            self._settle(view)
        offset = self._raw.tell()
        written = self._raw.write(view)  # a buffered file writes everything it is given
        if len(view) >= _DEFER_BYTES and torch.serialization.get_crc32_options():
            self._pending = (offset, len(view))
        else:
            self._crc = crc32(view, self._crc)
        return written

    def _settle(self, following: memoryview | None) -> None:
        """Fold the pending write's CRC in: from ``following`` when it is that record's zip data descriptor
        (``PK\x07\x08``, CRC-32, sizes), else by reading the bytes back."""
        assert self._pending is not None
        offset, length = self._pending
        self._pending = None
        crc = _descriptor_crc(following, length) if following is not None else None
        if crc is None:
            self._raw.flush()
            (crc,) = crc32_ranges(Path(self._raw.name), [(offset, length)])
        self._crc = crc32_combine(self._crc, crc, length)

    def tell(self) -> int:
        if self._pending is not None:
            self._settle(None)
        position = self._raw.tell()
        self._segments[(self._start, position - self._start)] = self._crc
        self._start, self._crc = position, 0
        return position

    def __getattr__(self, name: str) -> Any:  # fileno, flush, close, writable ... of the file itself
        return getattr(self._raw, name)


def _descriptor_crc(view: memoryview, length: int) -> int | None:
    """The CRC-32 in a zip data descriptor for a record of ``length`` bytes, or None if ``view`` is not one."""
    if len(view) == 16:
        sizes = struct.unpack_from("<II", view, 8)
    elif len(view) == 24:  # zip64: 8-byte sizes
        sizes = struct.unpack_from("<QQ", view, 8)
    else:
        return None
    if bytes(view[:4]) != _DESCRIPTOR or sizes != (length, length):  # stored, not compressed: sizes equal
        return None
    return int(struct.unpack_from("<I", view, 4)[0])


class ChecksummingFileSystem(FileSystem):
    """PyTorch's ``FileSystem`` whose write streams record per-item CRC-32s, by file name."""

    def __init__(self) -> None:
        super().__init__()
        # One entry per file; DCP's writer threads each add their own key (atomic under the GIL).
        self.segments: dict[str, dict[tuple[int, int], int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        segments: dict[tuple[int, int], int] = {}
        self.segments[Path(path).name] = segments
        with super().create_stream(path, mode) as stream:
            # PyTorch types create_stream's stream as IOBase; it is a binary file.
            yield ChecksummingStream(stream, segments)  # type: ignore[arg-type]
