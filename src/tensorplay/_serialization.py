"""``tensorplay.save`` / ``tensorplay.load``: PyTorch's, with an integrity check on load and an atomic save.

``torch.load`` never checks the CRC-32 each zip record carries, so a flipped bit
in tensor bytes loads as a silently wrong value. :func:`load` reads every record
first (:mod:`tensorplay._zip_records`): damage or truncation is a
:class:`DamagedFileError` naming the file and the record. :func:`save` to a path
writes a temporary sibling, fsyncs it and renames it into place, so a crash never
leaves half a file where the previous one was.
"""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path
from typing import IO, Any

import torch

from tensorplay._zip_records import DamagedFileError, check_zip_records, is_zip

__all__ = ["DamagedFileError", "load", "save"]


def save(obj: object, f: str | os.PathLike | IO[bytes], pickle_module: Any = pickle,
         pickle_protocol: int = torch.serialization.DEFAULT_PROTOCOL, _use_new_zipfile_serialization: bool = True,
         _disable_byteorder_record: bool = False) -> None:
    """``torch.save``; to a path, atomically (temporary sibling, fsync, rename)."""
    kwargs = {"pickle_module": pickle_module, "pickle_protocol": pickle_protocol,
              "_use_new_zipfile_serialization": _use_new_zipfile_serialization,
              "_disable_byteorder_record": _disable_byteorder_record}
    if not isinstance(f, (str, os.PathLike)):
        torch.save(obj, f, **kwargs)
        return
    path = Path(f)
    tmp = path.parent / f".{path.name}.saving-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as out:
            torch.save(obj, out, **kwargs)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(f: str | os.PathLike | IO[bytes], map_location: Any = None, pickle_module: Any = None, *,
         weights_only: bool | None = None, mmap: bool | None = None, **pickle_load_args: Any) -> Any:
    """``torch.load`` (``weights_only=True`` by default, as PyTorch 2.13) after checking every zip record's CRC-32.

    Raises :class:`DamagedFileError` (a ``ValueError``) naming the file and the
    damaged record instead of returning wrong values. Files in PyTorch's legacy
    (non-zip) format carry no checksums and load unchecked.
    """
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as stream:
            _check(stream, os.fspath(f))
    elif hasattr(f, "seek") and hasattr(f, "tell"):
        _check(f, getattr(f, "name", None) or repr(f))
    return torch.load(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **pickle_load_args)


def _check(stream: IO[bytes], source: str) -> None:
    if is_zip(stream):
        check_zip_records(stream, source)
        return
    start = stream.tell()
    magic = stream.read(4)
    stream.seek(start)
    if magic[:2] == b"PK":  # a zip whose end record is gone: truncated
        raise DamagedFileError(f"{source}: the zip archive is truncated (its end-of-archive record is missing)")
