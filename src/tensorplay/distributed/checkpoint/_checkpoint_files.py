"""The files of one checkpoint directory, named and opened so that a hostile entry reads nothing outside it.

[Note: bounded checkpoint reads]
A checkpoint is untrusted input. Whatever its ``.metadata`` or manifest say,
a load reads only regular files inside the checkpoint directory, and never more
bytes than those files hold:

- a storage path in ``.metadata`` must be relative and stay in the directory
  (no ``..``, no absolute path), and the file it names, once symlinks are
  resolved, must still lie inside the directory;
- every file is opened without blocking and must be a regular file (a symlink to
  ``/dev/zero`` or a FIFO is refused before a byte is read);
- ``.metadata`` and the manifest are read whole, so their size on disk is capped
  (:data:`MAX_METADATA_BYTES`); a shard's items are read only after their declared
  ranges are checked against the file's size, so a declared length is never
  allocated before it is known to be there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from tensorplay.distributed.checkpoint._errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["MAX_METADATA_BYTES", "check_storage_name", "open_regular", "read_capped", "resolve_inside"]

#: The most bytes ``.metadata`` or the manifest may hold (both are read whole).
MAX_METADATA_BYTES = 1 << 30


def check_storage_name(name: str, source: object) -> None:
    """Refuse a storage path (from ``source``'s metadata) that is absolute or leaves the checkpoint directory."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not name or os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts:
        raise UnsafeCheckpointError(f"{source}: stores data at {name!r}, outside the checkpoint directory; "
                                    "a checkpoint may only name files inside its own directory")


def resolve_inside(directory: Path, name: str) -> Path:
    """``directory / name`` with symlinks resolved, refused unless it lies inside ``directory``."""
    check_storage_name(name, directory)
    root = Path(os.path.realpath(directory))
    path = Path(os.path.realpath(directory / name))  # a symlink loop stays unresolved (then open fails)
    if path != root and root not in path.parents:
        raise UnsafeCheckpointError(f"{directory / name}: resolves to {path}, outside the checkpoint directory "
                                    f"{root}; refusing to read it")
    return path


def open_regular(path: Path) -> int:
    """``path`` opened for reading without blocking, refused unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: the file is missing") from None
    except OSError as error:  # a symlink loop (ELOOP), no permission
        raise CorruptCheckpointError(f"{path}: cannot be opened ({error.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeCheckpointError(f"{path}: is not a regular file (a device, FIFO or socket); refusing to read it")
    return fd


def read_capped(path: Path, cap: int = MAX_METADATA_BYTES) -> bytes:
    """The whole of the regular file ``path``, refused without reading when it holds more than ``cap`` bytes."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise CorruptCheckpointError(f"{path}: holds {size} bytes, more than the {cap} expected; the file is "
                                         "damaged or is not a checkpoint's")
        chunks, left = [], size + 1  # one byte more: a file that grows while read is refused too
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) != size:
            raise CorruptCheckpointError(f"{path}: changed size while it was read ({size} -> {len(data)} bytes)")
        return data
    finally:
        os.close(fd)
