"""Check the CRC-32 that every record of a ``torch.save`` zip archive carries.

PyTorch writes a CRC-32 per record but never checks it on load, so a flipped bit
in tensor bytes loads as a wrong value. :func:`check_zip_records` reads every
record and turns any CRC mismatch or truncation into a ``ValueError`` naming the
file and the record. ``torch.save`` stores its records uncompressed; their bytes
are checksummed straight from the stream with the fast CRC-32 of
``tensorplay._crc32`` (zipfile's own check runs zlib's, 3x slower); any other
record is read through :mod:`zipfile`, which checks it.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from typing import IO

from tensorplay._crc32 import crc32

__all__ = ["DamagedFileError", "check_zip_records", "is_zip"]

_CHUNK = 1 << 24


class DamagedFileError(ValueError):
    """A serialized file is truncated or a record's bytes do not match its CRC-32."""


def is_zip(stream: IO[bytes]) -> bool:
    start = stream.tell()
    try:
        return zipfile.is_zipfile(stream)
    finally:
        stream.seek(start)


def check_zip_records(stream: IO[bytes], source: str) -> None:
    """Read every record of the zip in ``stream``; raise :class:`DamagedFileError` on damage.

    The stream is left where it started.
    """
    start = stream.tell()
    try:
        try:
            archive = zipfile.ZipFile(stream)
        except (zipfile.BadZipFile, EOFError, OSError) as error:
            raise DamagedFileError(f"{source}: not a readable zip archive, truncated or damaged ({error})") from None
        with archive:
            for info in archive.infolist():
                _check_record(archive, info, source)
    finally:
        stream.seek(start)


def _check_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> None:
    if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & _ENCRYPTED and archive.fp is not None:
        _check_stored_record(archive.fp, info, source)
        return
    try:
        with archive.open(info) as record:
            while record.read(_CHUNK):
                pass
    except (zipfile.BadZipFile, zlib.error) as error:
        raise DamagedFileError(f"{source}: record {info.filename!r} is damaged: {error}") from None
    except (EOFError, OSError, ValueError) as error:
        raise DamagedFileError(f"{source}: record {info.filename!r} is truncated ({error})") from None


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_ENCRYPTED = 0x1


def _check_stored_record(stream: IO[bytes], info: zipfile.ZipInfo, source: str) -> None:
    """Check an uncompressed record's CRC-32 against its bytes, read in bounded chunks."""
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size:
        raise DamagedFileError(f"{source}: record {info.filename!r} is truncated (its header is cut off)")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise DamagedFileError(f"{source}: record {info.filename!r} is damaged: bad local header")
    stream.seek(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)
    crc, left = 0, info.compress_size
    while left:
        chunk = stream.read(min(_CHUNK, left))
        if not chunk:
            raise DamagedFileError(f"{source}: record {info.filename!r} is truncated "
                                   f"({left} of its {info.compress_size} bytes missing)")
        crc, left = crc32(chunk, crc), left - len(chunk)
    if crc != info.CRC:
        raise DamagedFileError(f"{source}: record {info.filename!r} is damaged: Bad CRC-32 "
                               f"{crc:#010x}, the archive says {info.CRC:#010x}")
