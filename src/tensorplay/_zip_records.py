"""Check the CRC-32 that every record of a ``torch.save`` zip archive carries.

PyTorch writes a CRC-32 per record but never checks it on load, so a flipped bit
in tensor bytes loads as a wrong value. :func:`check_zip_records` reads every
record through :mod:`zipfile` (which verifies the CRC) and turns any mismatch or
truncation into a ``ValueError`` naming the file and the record.
"""

from __future__ import annotations

import zipfile
from typing import IO

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
    try:
        with archive.open(info) as record:
            while record.read(_CHUNK):
                pass
    except zipfile.BadZipFile as error:
        raise DamagedFileError(f"{source}: record {info.filename!r} is damaged: {error}") from None
    except (EOFError, OSError, ValueError) as error:
        raise DamagedFileError(f"{source}: record {info.filename!r} is truncated ({error})") from None
