"""The manifest: a CRC-32 per stored item (tensor or bytes blob) and per file of a checkpoint.

[Note: manifest layout]
``.tensorplay_manifest.json`` sits beside DCP's ``.metadata`` (PyTorch's DCP ignores
it, so our checkpoints load there too)::

    {"format": "tensorplay.distributed.checkpoint", "version": 1, "checksum": "crc32",
     "files": {"__0_0.distcp": {"size": 1577, "digest": 123, "items": [[offset, length, crc32, fqn], ...]},
               ".metadata": {"size": 900, "digest": 456, "items": []}}}

An item's ``crc32`` covers its stored bytes. A data file's ``digest`` is the
CRC-32 of its item table (so any changed byte inside an item changes it) and is
checked with the size; bytes outside every item are none in DCP's layout. A file
with no items (``.metadata``) has the CRC-32 of its whole content as digest. CRC-32
(zlib's; [Note: which CRC-32 implementation]) was chosen over blake2b by measurement, and it
catches every burst error up to 32 bits; this is an integrity check, not a signature.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tensorplay._crc32 import crc32
from tensorplay.distributed.checkpoint._errors import CorruptCheckpointError

__all__ = ["MANIFEST_NAME", "FileEntry", "ItemSum", "Manifest", "crc32_ranges", "item_table_digest"]

MANIFEST_NAME = ".tensorplay_manifest.json"
FORMAT = "tensorplay.distributed.checkpoint"
VERSION = 1
#: Below this many bytes in all, checksums run on the calling thread.
_PARALLEL_BYTES = 32 << 20
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ItemSum:
    """One stored item's byte range in its file and the CRC-32 of those bytes."""

    offset: int
    length: int
    crc32: int
    fqn: str


@dataclass
class FileEntry:
    size: int
    digest: int
    items: list[ItemSum] = field(default_factory=list)


def crc32_ranges(path: Path, ranges: list[tuple[int, int]]) -> list[int]:
    """CRC-32 of each ``(offset, length)`` byte range of ``path``.

    Read in bounded chunks with ``pread`` (no mapping, so the file does not count in
    this process's memory), on a few threads when there is enough to share: both the
    read and zlib's CRC release the GIL.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        def one(span: tuple[int, int]) -> int:
            offset, length = span
            crc, done = 0, 0
            while done < length:
                chunk = os.pread(fd, min(_CHUNK, length - done), offset + done)
                if not chunk:
                    raise CorruptCheckpointError(f"{path}: ends at byte {offset + done}, inside bytes "
                                                 f"{offset}..{offset + length} of a stored item: truncated")
                crc = crc32(chunk, crc)
                done += len(chunk)
            return crc

        if sum(n for _, n in ranges) < _PARALLEL_BYTES or len(ranges) < 2:
            return [one(span) for span in ranges]
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            return list(pool.map(one, ranges))
    finally:
        os.close(fd)


def item_table_digest(items: Iterable[ItemSum]) -> int:
    table = ";".join(f"{i.offset},{i.length},{i.crc32}" for i in sorted(items, key=lambda i: i.offset))
    return crc32(table.encode())


@dataclass
class Manifest:
    files: dict[str, FileEntry] = field(default_factory=dict)

    def item(self, relative_path: str, offset: int) -> ItemSum | None:
        entry = self.files.get(relative_path)
        if entry is None:
            return None
        return next((i for i in entry.items if i.offset == offset), None)

    def to_json(self) -> str:
        files = {name: {"size": e.size, "digest": e.digest,
                        "items": [[i.offset, i.length, i.crc32, i.fqn] for i in e.items]}
                 for name, e in sorted(self.files.items())}
        return json.dumps({"format": FORMAT, "version": VERSION, "checksum": "crc32", "files": files})

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT or raw.get("version") != VERSION:
                raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}")
            return cls({name: FileEntry(int(e["size"]), int(e["digest"]),
                                        [ItemSum(int(o), int(n), int(c), str(q)) for o, n, c, q in e["items"]])
                        for name, e in raw["files"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptCheckpointError(f"{source}: the checkpoint manifest is damaged ({error})") from None

    def write(self, directory: Path) -> None:
        path = directory / MANIFEST_NAME
        with open(path, "w") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, directory: Path) -> Manifest | None:
        path = directory / MANIFEST_NAME
        if not path.exists():
            return None
        return cls.from_json(path.read_text(), str(path))
