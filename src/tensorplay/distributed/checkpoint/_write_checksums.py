"""CRC-32 of each stored item computed while DCP writes it, so a save never reads its files back.

[Note: checksums on the write path]
DCP's writer calls ``stream.tell()`` right before and right after it writes each
item, and ``torch.save`` into a stream only ever calls ``write`` (checked on
PyTorch 2.13). So the bytes between two ``tell()`` calls are exactly one item:
:class:`ChecksummingStream` keeps a running CRC-32 over ``write`` and closes a
segment at every ``tell()``. An item whose range matches no segment (another
writer, a transform extension) is checksummed by reading it back instead.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["ChecksummingFileSystem", "ChecksummingStream"]


class ChecksummingStream:
    """A binary file opened for writing that records ``{(offset, length): crc32}`` between ``tell()`` calls."""

    def __init__(self, raw: IO[bytes], segments: dict[tuple[int, int], int]) -> None:
        self._raw = raw
        self._segments = segments
        self._start = raw.tell()
        self._crc = 0

    def write(self, data: Any) -> int:
        written = self._raw.write(data)  # a buffered file writes everything it is given
        self._crc = zlib.crc32(data, self._crc)
        return written

    def tell(self) -> int:
        position = self._raw.tell()
        self._segments[(self._start, position - self._start)] = self._crc
        self._start, self._crc = position, 0
        return position

    def __getattr__(self, name: str) -> Any:  # fileno, flush, close, writable ... of the file itself
        return getattr(self._raw, name)


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
