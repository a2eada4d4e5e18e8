"""Check the CRC-32 that every record of a ``torch.save`` zip archive carries, in bounded time and memory.

PyTorch writes a CRC-32 per record but never checks it on load, so a flipped bit
in tensor bytes loads as a wrong value. :func:`check_zip_records` reads the
records and turns any CRC mismatch or truncation into a ``ValueError`` naming the
file and the record. ``torch.save`` stores its records uncompressed; their bytes
are checksummed straight from the stream with the fast CRC-32 of
``tensorplay._crc32`` (zipfile's own check runs zlib's, 3x slower); any other
record is read through :mod:`zipfile`, which checks it.

[Note: a bounded record check]
A hostile archive must not make the check cost more than ``torch.load`` would:

- the records' byte ranges are laid out first, from the central directory and
  each local header: a record that overlaps another, or runs past the central
  directory, is refused before any of its bytes is read (many directory entries
  pointing at one record would otherwise read it again and again);
- a stored record must declare equal stored and unstored sizes, so its check
  reads at most its own bytes, which lie inside the file;
- a compressed record (``torch.save`` never writes one) is decompressed only if
  ``torch.load`` would read it: the archive's ``data.pkl``, its small format
  records, and the ``data/<key>`` records its pickle names (found by reading the
  pickle with stubs, so no class is built and no code runs). A record deflated
  from gigabytes that nothing names is skipped, as ``torch.load`` skips it.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import IO, Any

from tensorplay._crc32 import crc32

__all__ = ["DamagedFileError", "check_zip_records", "is_zip"]

_CHUNK = 1 << 24
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_ENCRYPTED = 0x1
#: Records ``torch.load`` reads besides those its pickle names (relative to the archive's top directory).
_FORMAT_RECORDS = frozenset({"data.pkl", "byteorder", "version", ".format_version", ".storage_alignment",
                             ".data/version", ".data/serialization_id"})


class DamagedFileError(ValueError):
    """A serialized file is truncated or a record's bytes do not match its CRC-32."""


def is_zip(stream: IO[bytes]) -> bool:
    start = stream.tell()
    try:
        return zipfile.is_zipfile(stream)
    finally:
        stream.seek(start)


@dataclass(frozen=True)
class _Span:
    """Where one record's bytes lie: ``data_start .. data_end`` of the archive, after its local header."""

    info: zipfile.ZipInfo
    data_start: int

    @property
    def data_end(self) -> int:
        return self.data_start + self.info.compress_size


def check_zip_records(stream: IO[bytes], source: str) -> None:
    """Check the records of the zip in ``stream`` that ``torch.load`` reads; raise :class:`DamagedFileError`.

    Bounded as [Note: a bounded record check] says. The stream is left where it started.
    """
    start = stream.tell()
    try:
        try:
            archive = zipfile.ZipFile(stream)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
            raise DamagedFileError(f"{source}: not a readable zip archive, truncated or damaged ({error})") from None
        with archive:
            spans = _laid_out(archive, source)
            read = _records_read(archive, spans) if any(_compressed(s.info) for s in spans) else None
            for span in spans:
                if read is None or not _compressed(span.info) or span.info.filename in read:
                    _check_record(archive, span, source)
    finally:
        stream.seek(start)


def _compressed(info: zipfile.ZipInfo) -> bool:
    return info.compress_type != zipfile.ZIP_STORED or bool(info.flag_bits & _ENCRYPTED)


def _laid_out(archive: zipfile.ZipFile, source: str) -> list[_Span]:
    """Every record's byte range, checked to lie inside the archive without overlapping another."""
    assert archive.fp is not None
    end = getattr(archive, "start_dir", None)
    spans = sorted((_span(archive.fp, info, source) for info in archive.infolist()),
                   key=lambda s: s.info.header_offset)
    for span, following in zip(spans, [*spans[1:], None], strict=True):
        info = span.info
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise DamagedFileError(f"{source}: record {info.filename!r} is damaged: stored uncompressed, but it "
                                   f"declares {info.compress_size} bytes stored and {info.file_size} unstored")
        limit = following.info.header_offset if following is not None else end
        if limit is not None and span.data_end > limit:
            what = f"record {following.info.filename!r}" if following is not None else "the central directory"
            raise DamagedFileError(f"{source}: record {info.filename!r} declares {info.compress_size} bytes, which "
                                   f"run into {what} at byte {limit}: the records overlap or the sizes are damaged")
    return spans


def _span(stream: IO[bytes], info: zipfile.ZipInfo, source: str) -> _Span:
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size:
        raise DamagedFileError(f"{source}: record {info.filename!r} is truncated (its header is cut off)")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise DamagedFileError(f"{source}: record {info.filename!r} is damaged: bad local header")
    return _Span(info, info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)


def _check_record(archive: zipfile.ZipFile, span: _Span, source: str) -> None:
    info = span.info
    if not _compressed(info) and archive.fp is not None:
        _check_stored_record(archive.fp, span, source)
        return
    try:
        with archive.open(info) as record:  # zipfile stops at the declared size and checks the CRC
            while record.read(_CHUNK):
                pass
    except (zipfile.BadZipFile, zlib.error) as error:
        raise DamagedFileError(f"{source}: record {info.filename!r} is damaged: {error}") from None
    except (EOFError, OSError, ValueError, NotImplementedError) as error:
        raise DamagedFileError(f"{source}: record {info.filename!r} is truncated ({error})") from None


def _check_stored_record(stream: IO[bytes], span: _Span, source: str) -> None:
    """Check an uncompressed record's CRC-32 against its bytes, read in bounded chunks."""
    info = span.info
    stream.seek(span.data_start)
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


def _records_read(archive: zipfile.ZipFile, spans: list[_Span]) -> set[str] | None:
    """The names of the records ``torch.load`` reads, or None (check them all) without a readable ``data.pkl``."""
    pickles = [s.info for s in spans if s.info.filename.rsplit("/", 1)[-1] == "data.pkl"]
    if len(pickles) != 1:
        return None
    prefix = pickles[0].filename[: -len("data.pkl")]
    try:
        with archive.open(pickles[0]) as stream:
            keys = _StubUnpickler(stream).storage_keys()
    except Exception:  # noqa: BLE001 - a damaged pickle: torch.load fails on it; check every record
        return None
    return {prefix + name for name in _FORMAT_RECORDS} | {f"{prefix}data/{key}" for key in keys}


class _Stub:
    """Whatever the pickle asks to build: accepts every call and keeps nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _StubUnpickler(pickle.Unpickler):
    """Reads a ``torch.save`` pickle for the storage keys it names; every global is a :class:`_Stub`."""

    def __init__(self, stream: IO[bytes]) -> None:
        super().__init__(stream)
        self._keys: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 3:
            self._keys.add(str(pid[2]))  # ("storage", storage type, key, location, numel)
        return _Stub()

    def storage_keys(self) -> set[str]:
        self.load()
        return self._keys
