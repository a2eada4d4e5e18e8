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
catches every burst error up to 32 bits; this is an integrity check against damage, not against an
attacker: the manifest sits beside the data, and whoever can rewrite the data can rewrite it too.

[Note: pinning a checkpoint]
``save`` returns the checkpoint's pin: the SHA-256 of the manifest's bytes and of
``.metadata`` (:func:`pinned_digest`, also on the writer as ``manifest_digest``).
``load(..., expected_digest=pin)`` refuses a checkpoint whose manifest or metadata
differ, so a recomputed manifest, a swapped ``.metadata`` or another checkpoint
put in its place is an error. The data files are covered through the manifest's
CRC-32 of each item: that catches any damage, but CRC-32 is not a cryptographic
hash, so a deliberate attacker who can write the data files could forge values
that match it. Against such an attacker, keep checkpoints where only the job can
write, or sign the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tensorplay._crc32 import crc32
from tensorplay.distributed.checkpoint._checkpoint_files import read_capped, resolve_inside
from tensorplay.distributed.checkpoint._errors import CorruptCheckpointError

__all__ = ["MANIFEST_NAME", "FileEntry", "ItemSum", "Manifest", "check_pinned", "crc32_ranges", "item_table_digest",
           "pinned_digest"]

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
    def from_json(cls, text: str | bytes, source: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT or raw.get("version") != VERSION:
                raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}")
            return cls({name: FileEntry(int(e["size"]), int(e["digest"]),
                                        [ItemSum(int(o), int(n), int(c), str(q)) for o, n, c, q in e["items"]])
                        for name, e in raw["files"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptCheckpointError(f"{source}: the checkpoint manifest is damaged ({error})") from None

    def write(self, directory: Path) -> bytes:
        """Write the manifest into ``directory``, fsynced; returns the bytes written."""
        data = self.to_json().encode()
        with open(directory / MANIFEST_NAME, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return data

    @classmethod
    def read(cls, directory: Path) -> Manifest | None:
        path = directory / MANIFEST_NAME
        if not path.exists() and not path.is_symlink():
            return None
        return cls.from_json(read_capped(resolve_inside(directory, MANIFEST_NAME)), str(path))


def pinned_digest(manifest: bytes, metadata: bytes) -> str:
    """The checkpoint's pin: SHA-256 (hex) of its manifest's and its ``.metadata``'s bytes."""
    digest = hashlib.sha256(b"tensorplay.distributed.checkpoint pin v1\0")
    digest.update(len(manifest).to_bytes(8, "little"))
    digest.update(manifest)
    digest.update(metadata)
    return digest.hexdigest()


def check_pinned(expected: str | None, manifest: bytes | None, metadata: bytes, directory: Path) -> None:
    """Refuse a checkpoint whose manifest and metadata do not hash to the pinned ``expected`` digest."""
    if expected is None:
        return
    if manifest is None:
        raise CorruptCheckpointError(f"{directory}: has no {MANIFEST_NAME}, so it cannot be the checkpoint "
                                     f"pinned by expected_digest={expected!r}")
    got = pinned_digest(manifest, metadata)
    if got != expected:
        raise CorruptCheckpointError(f"{directory}: its manifest and metadata hash to {got}, the pinned "
                                     f"expected_digest is {expected}: this is not the checkpoint that was saved "
                                     "(replaced, rewritten or damaged)")
