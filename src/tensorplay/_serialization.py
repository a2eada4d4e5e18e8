"""``tensorplay.save`` / ``tensorplay.load``: PyTorch's, with an integrity check on load and an atomic save.

``torch.load`` never checks the CRC-32 each zip record carries, so a flipped bit
in tensor bytes loads as a silently wrong value. :func:`load` reads every record
first (:mod:`tensorplay._zip_records`): damage or truncation is a
:class:`DamagedFileError` naming the file and the record. :func:`save` to a path
writes a temporary sibling, fsyncs it and renames it into place, so a crash never
leaves half a file where the previous one was.

Byte order: ``torch.save`` records the writer's (``byteorder``) and ``torch.load``
converts a foreign one, except onto the meta device, where PyTorch byte-swaps a
meta storage and the process crashes; :func:`load` refuses that case with an
error naming the file, and an unknown recorded order is a :class:`DamagedFileError`.
"""

from __future__ import annotations

import os
import pickle
import sys
import uuid
from pathlib import Path
from typing import IO, Any

import torch

from tensorplay._disk_space import no_space_error
from tensorplay._zip_records import DamagedFileError, check_zip_records, is_zip

__all__ = ["DamagedFileError", "load", "save", "stored_byte_order"]


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
    except (OSError, RuntimeError) as error:
        tmp.unlink(missing_ok=True)  # before measuring the room left: its bytes are freed
        full = no_space_error(error, path.parent, _serialized_size(obj, kwargs), str(path))
        if full is None:
            raise
        raise full from error
    finally:
        tmp.unlink(missing_ok=True)


class _Counter:
    """A write-only sink that counts what ``torch.save`` writes into it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        self.size += memoryview(data).nbytes
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def _serialized_size(obj: object, kwargs: dict[str, Any]) -> int:
    """How many bytes ``torch.save`` writes for ``obj`` (serialized once more, into a counter)."""
    counter = _Counter()
    torch.save(obj, counter, **kwargs)  # type: ignore[arg-type]  # a write-only file object
    return counter.size


def load(f: str | os.PathLike | IO[bytes], map_location: Any = None, pickle_module: Any = None, *,
         weights_only: bool | None = None, mmap: bool | None = None, **pickle_load_args: Any) -> Any:
    """``torch.load`` (``weights_only=True`` by default, as PyTorch 2.13) after checking every zip record's CRC-32.

    Raises :class:`DamagedFileError` (a ``ValueError``) naming the file and the
    damaged record instead of returning wrong values. Files in PyTorch's legacy
    (non-zip) format carry no checksums and load unchecked.
    """
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as stream:
            _check(stream, os.fspath(f), map_location)
    elif hasattr(f, "seek") and hasattr(f, "tell"):
        _check(f, getattr(f, "name", None) or repr(f), map_location)
    return torch.load(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **pickle_load_args)


def _check(stream: IO[bytes], source: str, map_location: Any) -> None:
    if is_zip(stream):
        check_zip_records(stream, source)
        order = stored_byte_order(stream, source)
        if order != sys.byteorder and _to_meta(map_location):
            raise ValueError(f"{source}: stored {order}-endian, and PyTorch cannot convert a foreign byte order "
                             f"onto the meta device (this host is {sys.byteorder}-endian): load it with "
                             "map_location='cpu' and move it with .to('meta')")
        return
    start = stream.tell()
    magic = stream.read(4)
    stream.seek(start)
    if magic[:2] == b"PK":  # a zip whose end record is gone: truncated
        raise DamagedFileError(f"{source}: the zip archive is truncated (its end-of-archive record is missing)")


def stored_byte_order(stream: IO[bytes], source: str) -> str:
    """The byte order the ``torch.save`` zip in ``stream`` records (``"little"`` or ``"big"``), as ``torch.load``
    reads it: without a record, little unless ``torch.serialization.set_default_load_endianness`` says otherwise.

    Raises :class:`DamagedFileError` naming ``source`` for any other value; ``stream``'s position is kept.
    """
    start = stream.tell()
    try:
        reader = torch._C.PyTorchFileReader(stream)
        recorded = reader.get_record("byteorder") if reader.has_record("byteorder") else None
    except RuntimeError as error:
        raise DamagedFileError(f"{source}: not a readable torch.save archive ({error})") from None
    finally:
        stream.seek(start)
    if recorded is None:
        endianness = torch.serialization.LoadEndianness
        default = torch.serialization.get_default_load_endianness()
        return {endianness.BIG: "big", endianness.NATIVE: sys.byteorder}.get(default, "little")  # type: ignore[arg-type]
    if recorded not in (b"little", b"big"):
        raise DamagedFileError(f"{source}: records byte order {bytes(recorded[:16])!r}, expected b'little' or "
                               "b'big': the file is damaged or was not written by torch.save")
    return recorded.decode()


def _to_meta(map_location: Any) -> bool:
    """Whether ``map_location`` (a device, a name, or a dict of them) puts storages on the meta device."""
    targets = map_location.values() if isinstance(map_location, dict) else [map_location]
    return any(isinstance(t, (str, torch.device)) and str(t).split(":")[0] == "meta" for t in targets)
