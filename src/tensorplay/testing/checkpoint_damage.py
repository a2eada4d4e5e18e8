"""Damage a checkpoint the ways a failing disk or an adversary would: for tests and the fuzz benchmark.

Each damage takes a checkpoint directory (``dcp.save`` output) and a
``random.Random``, changes the directory in place and returns a one-line
description. :data:`KINDS` names the classes :func:`damage` draws from:
truncation, bit flips, size fields (item offsets and lengths in ``.metadata``,
size fields of the zip records inside an item), symlinks, and path fields
(storage paths in ``.metadata``). Edits of ``.metadata`` recompute the manifest
to match, as an adversary would, so the load's own bounds are what is tested; the
other kinds are damage, which the manifest must catch.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorplay._crc32 import crc32
from tensorplay.distributed.checkpoint._manifest import (
    FileEntry,
    ItemSum,
    Manifest,
    crc32_ranges,
    item_table_digest,
)

__all__ = ["KINDS", "damage", "read_metadata", "recompute_manifest", "write_metadata"]

METADATA = ".metadata"


def read_metadata(root: Path) -> Any:
    """The checkpoint's metadata, unpickled with plain ``pickle`` (only for checkpoints this process made)."""
    with open(root / METADATA, "rb") as f:
        return pickle.load(f)  # noqa: S301 - our own test checkpoint


def write_metadata(root: Path, metadata: Any) -> None:
    """Replace ``.metadata`` and recompute the manifest to match (an adversary's edit)."""
    (root / METADATA).write_bytes(pickle.dumps(metadata))
    recompute_manifest(root)


def recompute_manifest(root: Path) -> None:
    """A manifest that agrees with the files as they are now (where the metadata's ranges lie in them)."""
    metadata = read_metadata(root)
    items: dict[str, list[ItemSum]] = {}
    for index, info in metadata.storage_data.items():
        path = root / str(info.relative_path)
        size = path.stat().st_size if path.is_file() and not path.is_symlink() else -1
        inside = 0 <= info.offset and 0 <= info.length and info.offset + info.length <= size
        crc = crc32_ranges(path, [(info.offset, info.length)])[0] if inside else 0  # read in bounded chunks
        items.setdefault(str(info.relative_path), []).append(ItemSum(info.offset, info.length, crc, index.fqn))
    files = {}
    for name, its in items.items():
        path = root / name
        size = path.stat().st_size if path.is_file() else 0
        files[name] = FileEntry(size, item_table_digest(its), sorted(its, key=lambda i: i.offset))
    meta_bytes = (root / METADATA).read_bytes()
    files[METADATA] = FileEntry(len(meta_bytes), crc32(meta_bytes))
    Manifest(files).write(root)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink())


def _truncate(root: Path, rng: random.Random) -> str:
    path = rng.choice(_files(root))
    size = path.stat().st_size
    keep = rng.randrange(size) if size else 0
    os.truncate(path, keep)
    return f"truncate {path.name} {size} -> {keep} bytes"


def _flip(root: Path, rng: random.Random) -> str:
    path = rng.choice(_files(root))
    data = bytearray(path.read_bytes())
    if not data:
        return f"flip: {path.name} is empty"
    flips = [rng.randrange(len(data)) for _ in range(rng.choice((1, 1, 2, 8)))]
    for at in flips:
        data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"flip {len(flips)} bit(s) of {path.name} at {flips[:3]}"


_HUGE = (1 << 31, (1 << 33) + 7, (1 << 62), 1 << 40)


def _metadata_sizes(root: Path, rng: random.Random) -> str:
    metadata = read_metadata(root)
    index = rng.choice(sorted(metadata.storage_data, key=lambda i: (i.fqn, str(i.offset))))
    info = metadata.storage_data[index]
    field = rng.choice(("offset", "length"))
    value = rng.choice([-1, 0, info.length + 1, info.length - 1, *_HUGE, rng.randrange(1 << 20)])
    metadata.storage_data[index] = dataclasses.replace(info, **{field: value})
    write_metadata(root, metadata)
    return f"metadata {index.fqn!r}: {field} {getattr(info, field)} -> {value}"


def _zip_sizes(root: Path, rng: random.Random) -> str:
    """Overwrite a size or offset field of a zip record inside one stored item (local header or directory)."""
    metadata = read_metadata(root)
    info = rng.choice(sorted(metadata.storage_data.values(), key=lambda i: (str(i.relative_path), i.offset)))
    path = root / str(info.relative_path)
    data = bytearray(path.read_bytes())
    item = data[info.offset:info.offset + info.length]
    signatures = [(b"PK\x03\x04", (18, 22, 26, 28)), (b"PK\x01\x02", (20, 24, 42)), (b"PK\x05\x06", (12, 16))]
    signature, fields = rng.choice(signatures)
    spots = [i for i in range(len(item) - 4) if item[i:i + 4] == signature]
    if not spots:
        return f"zip sizes: no {signature!r} in {path.name}"
    at = rng.choice(spots) + rng.choice(fields)
    value = rng.choice((0, 1, 0xFFFFFFFF, 0x7FFFFFFF, rng.randrange(1 << 32)))
    width = 2 if signature == b"PK\x03\x04" and at - spots[0] in (26, 28) else 4
    value &= (1 << (8 * width)) - 1
    item[at:at + width] = value.to_bytes(width, "little")
    data[info.offset:info.offset + info.length] = item
    path.write_bytes(bytes(data))
    return f"zip field at byte {info.offset + at} of {path.name} -> {value:#x}"


def _symlink(root: Path, rng: random.Random) -> str:
    names = [p.name for p in _files(root)]
    name = rng.choice(names)
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir(exist_ok=True)
    (outside / name).write_bytes((root / name).read_bytes())
    target = rng.choice(["/dev/zero", "/dev/urandom", str(outside / name), str(root / "absent"),
                         rng.choice(names), "/proc/self/mem"])
    (root / name).unlink()
    (root / name).symlink_to(target)
    return f"{name} -> symlink to {target}"


def _path_field(root: Path, rng: random.Random) -> str:
    metadata = read_metadata(root)
    index = rng.choice(sorted(metadata.storage_data, key=lambda i: (i.fqn, str(i.offset))))
    info = metadata.storage_data[index]
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir(exist_ok=True)
    (outside / info.relative_path).write_bytes((root / info.relative_path).read_bytes())
    new = rng.choice([f"../{outside.name}/{info.relative_path}", str(outside / info.relative_path),
                      "/etc/passwd", "absent.distcp", f"sub/../../{outside.name}/{info.relative_path}", "", ".",
                      "/dev/zero"])
    metadata.storage_data[index] = dataclasses.replace(info, relative_path=new)
    write_metadata(root, metadata)
    return f"metadata {index.fqn!r}: relative_path {info.relative_path!r} -> {new!r}"


KINDS: dict[str, Callable[[Path, random.Random], str]] = {
    "truncation": _truncate, "bit flip": _flip, "size field (metadata)": _metadata_sizes,
    "size field (zip)": _zip_sizes, "symlink": _symlink, "path field": _path_field,
}


def damage(root: Path, rng: random.Random, kind: str | None = None) -> tuple[str, str]:
    """Damage ``root`` with one kind of :data:`KINDS` (drawn when None); returns (kind, description)."""
    kind = kind if kind is not None else rng.choice(sorted(KINDS))
    return kind, KINDS[kind](root, rng)




# ---------------------------------------------------------------- hostile torch.save files (tp.load)

def add_bomb_record(path: Path, unpacked_bytes: int, name: str = "extra", damaged: bool = False) -> None:
    """Append a record ``name`` (in the archive's top directory) that deflates to ``unpacked_bytes`` zeros and,
    ``damaged``, carries a wrong CRC-32."""
    import zipfile

    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        top = archive.namelist()[0].split("/", 1)[0]
        with archive.open(f"{top}/{name}", "w", force_zip64=True) as record:
            chunk, left = bytes(1 << 24), unpacked_bytes
            while left:
                record.write(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
    if damaged:
        data = bytearray(path.read_bytes())
        at = data.rindex(b"PK\x01\x02" + data[data.rindex(b"PK\x01\x02") + 4:data.rindex(b"PK\x01\x02") + 12])
        data[at + 16] ^= 0xFF  # the record's CRC-32 in the central directory
        path.write_bytes(bytes(data))


def overlapping_records(data: bytes, copies: int) -> bytes:
    """``data`` (a zip) with its last record listed ``copies`` more times under new names, all at one offset."""
    end = data.rindex(b"PK\x05\x06")
    (entries, directory_size, directory_start) = struct.unpack_from("<HII", data, end + 10)
    last = data.rindex(b"PK\x01\x02", directory_start, end)
    name_length = struct.unpack_from("<H", data, last + 28)[0]
    entry = data[last:directory_start + directory_size]
    extra = b""
    for i in range(copies):
        old = entry[46:46 + name_length]
        name = (old.split(b"/", 1)[0] + f"/dup{i:06d}".encode()).ljust(name_length, b"_")[:name_length]
        extra += entry[:46] + name + entry[46 + name_length:]
    tail = bytearray(data[end:])
    struct.pack_into("<HHII", tail, 8, entries + copies, entries + copies, directory_size + len(extra),
                     directory_start)
    return data[:directory_start + directory_size] + extra + bytes(tail)
