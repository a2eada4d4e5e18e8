"""Read, verify and decode a rank's share of a checkpoint into a staging area; copy in place later.

[Note: all-or-nothing load]
PyTorch's reader copies each tensor into the model as soon as it is read, so an
error in the fifth file leaves four loaded, and a damaged shard on rank 1 leaves
rank 0 fully loaded. Ours reads every item this rank needs, checks its CRC-32
against the manifest (or, for a PyTorch checkpoint, the zip records' CRC-32s),
decodes it with ``weights_only`` semantics and checks its shape against the
destination. DCP's read step ends with an all-gather of every rank's outcome (its
agreement: one collective, an error on any rank is raised on all); only when every
rank succeeded does ``load`` call :meth:`StagedRead.commit`, which copies.

A plain tensor item is decoded onto the meta device (shape, dtype, strides and
where its data record lies: no data copied) and only its place is remembered;
the commit re-reads the verified bytes from the same open file into one reused
buffer and copies them into the destination. So the check costs one read and one
CRC pass over the bytes, and no rank holds more than one item at a time (holding
every decoded value until the agreement doubled the load's time on a loaded
machine: fresh pages for each). The commit first checks that no file changed
(size, mtime, inode of the open descriptor) since it was verified. Items with
storage transforms and byte blobs are held decoded, as before.

[Note: byte order]
``torch.save`` records the writer's byte order (a ``byteorder`` record) and
``torch.load`` byte-swaps a foreign one on the CPU, but re-reading raw bytes
would not, and ``torch.load`` onto the meta device of a foreign-order item
crashes the process (PyTorch byte-swaps the meta storage). So
:func:`native_byte_order` reads the record first: an item in this host's order
takes the raw path above, a foreign-order item is decoded on the CPU (converted
by ``torch.load``) and staged like a transformed one, and an unknown order is
refused naming the file.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from tensorplay._serialization import stored_byte_order
from tensorplay._zip_records import DamagedFileError
from tensorplay.distributed.checkpoint._checkpoint_files import open_regular
from tensorplay.distributed.checkpoint._errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["OpenFile", "Record", "StagedRead", "decode_blob", "decode_tensor", "native_byte_order", "read_exactly"]


@dataclass
class OpenFile:
    """A checkpoint file kept open from verification to commit, with what it looked like when verified."""

    path: Path
    fd: int
    stat: os.stat_result

    def unchanged(self) -> bool:
        now = os.fstat(self.fd)
        return (now.st_size, now.st_mtime_ns, now.st_ino) == (self.stat.st_size, self.stat.st_mtime_ns,
                                                               self.stat.st_ino)


@dataclass
class Record:
    """A verified tensor item to re-read at commit: ``nbytes`` at ``offset`` of ``file``, laid out as ``meta``."""

    item: ReadItem
    dest: torch.Tensor
    file: OpenFile
    offset: int
    nbytes: int
    meta: torch.Tensor  # the stored tensor on the meta device (shape, dtype, strides, storage offset)


@dataclass
class StagedRead:
    """What waits for every rank to succeed: decoded values, and the places of verified tensor records."""

    tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (item, dest, value)
    blobs: list[tuple[ReadItem, bytes]] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    files: dict[Path, OpenFile] = field(default_factory=dict)

    def open(self, path: Path) -> OpenFile:
        """``path`` opened once for this load (closed by :meth:`close`)."""
        if path not in self.files:
            fd = open_regular(path)
            self.files[path] = OpenFile(path, fd, os.fstat(fd))
        return self.files[path]

    def commit(self, planner: LoadPlanner) -> None:
        changed = [f.path for f in self.files.values() if not f.unchanged()]
        if changed:
            raise CorruptCheckpointError(f"{changed[0]}: changed on disk between its verification and the copy "
                                         "(is another job writing this checkpoint?); nothing was copied")
        for item, dest, value in self.tensors:
            dest.copy_(value)
            planner.commit_tensor(item, dest)
        self._commit_records(planner)
        for item, raw in self.blobs:
            planner.load_bytes(item, io.BytesIO(raw))  # bytes that passed a weights_only decode
        self.tensors.clear()
        self.blobs.clear()

    def _commit_records(self, planner: LoadPlanner) -> None:
        if not self.records:
            return
        raw = bytearray(max(1, max(r.nbytes for r in self.records)))
        view, buffer = memoryview(raw), torch.frombuffer(raw, dtype=torch.uint8)
        for record in self.records:
            direct = _direct_view(record)
            if direct is not None:  # the stored bytes are exactly the destination's: read straight into it
                read_exactly(record.file.fd, direct, record.offset, record.file.path)
                torch.autograd.graph.increment_version(record.dest)  # as copy_ would
                planner.commit_tensor(record.item, record.dest)
                continue
            read_exactly(record.file.fd, view[:record.nbytes], record.offset, record.file.path)
            meta = record.meta
            value = buffer[:record.nbytes].view(meta.dtype).as_strided(meta.shape, meta.stride(),
                                                                        meta.storage_offset())
            value = narrow_tensor_by_index(value, record.item.storage_offsets, record.item.lengths)
            record.dest.copy_(value)
            planner.commit_tensor(record.item, record.dest)
        self.records.clear()

    def close(self) -> None:
        for open_file in self.files.values():
            os.close(open_file.fd)
        self.files.clear()
        self.records.clear()


def _safe_torch_load(stream: IO[bytes], where: str, map_location: str = "cpu") -> object:
    try:
        return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(f"{where}: refused by the weights_only loader: {error}") from None
    except Exception as error:  # noqa: BLE001 - anything else is damaged bytes
        raise CorruptCheckpointError(f"{where}: cannot decode ({type(error).__name__}: {error})") from None


def decode_blob(stream: IO[bytes], where: str) -> None:
    """Check that a non-tensor item decodes under ``weights_only`` (the planner decodes it again at commit)."""
    _safe_torch_load(stream, where)


def _direct_view(record: Record) -> memoryview | None:
    """The destination's memory as bytes when the record can be read into it as is: a contiguous CPU tensor of
    the stored dtype and shape, the whole stored tensor wanted (no resharding slice)."""
    meta, dest = record.meta, record.dest
    if (dest.device.type != "cpu" or type(dest) is not torch.Tensor or dest.dtype != meta.dtype
            or not dest.is_contiguous() or not meta.is_contiguous() or meta.storage_offset() != 0
            or dest.shape != meta.shape or record.nbytes != dest.numel() * dest.element_size()
            or dest.layout != torch.strided or dest.is_quantized or dest.numel() == 0):
        return None
    return memoryview((ctypes.c_char * record.nbytes).from_address(dest.data_ptr())).cast("B")


def read_exactly(fd: int, target: memoryview, offset: int, path: Path) -> None:
    """Fill ``target`` with the bytes at ``offset`` of ``fd``; a file that ends first is truncated."""
    done, length = 0, len(target)
    while done < length:  # a short read is legal; an empty one is the end of the file
        got = os.preadv(fd, [target[done:]], offset + done)
        if got == 0:
            raise CorruptCheckpointError(f"{path}: ends at byte {offset + done}, inside bytes "
                                         f"{offset}..{offset + length} of a stored item: truncated")
        done += got


def decode_tensor(stream: IO[bytes], where: str, meta: bool = False) -> torch.Tensor:
    """The tensor stored in ``stream`` (``meta=True``: on the meta device, its data not read)."""
    value = _safe_torch_load(stream, where, "meta" if meta else "cpu")
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: expected a tensor, found {type(value).__name__}")
    return value


def native_byte_order(stream: IO[bytes], where: str) -> bool:
    """Whether the item in ``stream`` is stored in this host's byte order (see [Note: byte order])."""
    try:
        return stored_byte_order(stream, where) == sys.byteorder
    except DamagedFileError as error:
        raise CorruptCheckpointError(str(error)) from None
