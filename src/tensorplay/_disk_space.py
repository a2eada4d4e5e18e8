"""Name a full filesystem when a write fails on one: "no space left on <path>: needed ~N bytes".

``torch.save`` reports a short write as ``RuntimeError: [enforce fail at
inline_container.cc] unexpected pos 704 vs 598``, with no word of the cause.
:func:`no_space_error` looks at a failed write: an ``ENOSPC``/``EDQUOT`` anywhere in
the exception's chain, or a filesystem with less room left than the write needed,
is a full disk, and the returned ``OSError`` (errno ``ENOSPC``) says where, how much
was needed and how much is free.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["free_bytes", "no_space_error"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``directory``'s filesystem (None: unknown)."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _says_full(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL:
            return True
        current = current.__cause__ or current.__context__
    return False


def no_space_error(error: BaseException, directory: Path, needed: int, what: str) -> OSError | None:
    """An ``OSError(ENOSPC)`` naming ``directory`` when ``error`` (writing ``what``, ~``needed`` bytes) came
    from a full filesystem; None when it did not."""
    free = free_bytes(directory)
    if not _says_full(error) and (free is None or free >= needed):
        return None
    room = f", {free} bytes free" if free is not None else ""
    return OSError(errno.ENOSPC, f"no space left on {directory}: needed ~{needed} bytes for {what}{room}")
