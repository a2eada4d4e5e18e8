"""``FileSystemWriter`` / ``FileSystemReader``: PyTorch's file layout, saved atomically and read verified.

The files are DCP's own (``__<rank>_<n>.distcp`` + ``.metadata``), plus our
manifest ([Note: manifest layout] in ``_manifest``), so either implementation
reads the other's checkpoints. The writer publishes atomically ([Note: atomic
multi-rank save] in ``_atomic``); the reader never unpickles code and stages what
it reads ([Note: all-or-nothing load] in ``_staged_read``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import filesystem as _torch_fs
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemBase,
    SerializationFormat,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tensorplay._crc32 import checksum_threads, crc32, crc32_parallel
from tensorplay._disk_space import no_space_error
from tensorplay._zip_records import DamagedFileError, check_zip_records
from tensorplay.distributed.checkpoint import _atomic
from tensorplay.distributed.checkpoint._checkpoint_files import (
    MAX_METADATA_BYTES,
    check_storage_name,
    read_capped,
    resolve_inside,
)
from tensorplay.distributed.checkpoint._errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from tensorplay.distributed.checkpoint._item_reader import ItemBuffer, ViewReader
from tensorplay.distributed.checkpoint._manifest import (
    MANIFEST_NAME,
    FileEntry,
    ItemSum,
    Manifest,
    check_pinned,
    crc32_ranges,
    item_table_digest,
    pinned_digest,
)
from tensorplay.distributed.checkpoint._safe_unpickle import load_metadata
from tensorplay.distributed.checkpoint._staged_read import (
    OpenFile,
    Record,
    StagedRead,
    decode_blob,
    decode_tensor,
    native_byte_order,
)
from tensorplay.distributed.checkpoint._write_checksums import ChecksummingFileSystem

__all__ = ["FileSystem", "FileSystemBase", "FileSystemReader", "FileSystemWriter", "SerializationFormat"]

METADATA_NAME = ".metadata"
#: Bytes a stored item takes besides its tensor's (torch.save's zip records, pickle): for "needed ~N bytes".
_ITEM_OVERHEAD = 1 << 10


@dataclass
class _StagingPrefix(_StoragePrefix):
    """The coordinator's global plan tells every rank its file prefix and the shared staging directory."""

    staging_dir: str = ""


@dataclass
class _Summed:
    """A write result's storage info with the CRC-32 of its bytes, until the coordinator builds the manifest."""

    info: _StorageInfo
    crc32: int
    file_size: int


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class FileSystemWriter(_torch_fs.FileSystemWriter):
    """PyTorch's ``FileSystemWriter`` (same arguments), publishing the checkpoint atomically with a manifest.

    ``overwrite=True`` (the default) replaces a previous checkpoint at the path in one
    atomic step, without PyTorch's warning; ``overwrite=False`` refuses an existing one.
    ``use_collectives=False`` is refused: the atomic publish needs the coordinator's finish.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> writer = dcp.FileSystemWriter("ckpt", sync_files=False)   # skip fsync, e.g. on a RAM disk
        >>> dcp.save({"weight": tp.ones(2)}, storage_writer=writer)
        Metadata(...)
    """

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._target = Path(self.path)
        self.fs: ChecksummingFileSystem = ChecksummingFileSystem()
        self.manifest_digest: str | None = None  # of the last save, on the coordinator ([Note: pinning a checkpoint])
        self.staging: Path | None = None  # this save's staging directory, once known; removed if the save fails

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self._target = Path(checkpoint_id)
        self.path = self._target
        super().reset(None)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self._target

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.use_collectives:
            raise ValueError("tensorplay's FileSystemWriter publishes a checkpoint atomically from the coordinator "
                             "and needs use_collectives=True; for per-rank metadata pass PyTorch's "
                             "torch.distributed.checkpoint.FileSystemWriter as storage_writer")
        if not self.overwrite and (self._target / METADATA_NAME).exists():
            raise RuntimeError(f"a checkpoint already exists at {self._target} and overwrite=False")
        _atomic.check_replaceable(self._target)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        _atomic.remove_stale(self._target)  # before this save stages: leftovers of killed saves
        self.staging = _atomic.new_staging_dir(self._target)
        return [dataclasses.replace(plan, storage_data=_StagingPrefix(f"__{rank}_", str(self.staging)))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.path = self.staging = Path(plan.storage_data.staging_dir)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            _atomic.drop_cached(self._target, plan.storage_data.prefix)
            self.fs.segments.clear()
            results: list[WriteResult] = super().write_data(plan, planner).value()
        except (OSError, RuntimeError) as error:
            needed = sum(item.tensor_storage_size() or 0 for item in plan.items) + _ITEM_OVERHEAD * len(plan.items)
            full = no_space_error(error, self._target.parent, needed,
                                  f"this rank's files ({len(plan.items)} items) of {self._target}")
            if full is None:
                raise
            raise full from error
        return _done(self._summed(results))

    def discard_staging(self) -> None:
        """After a failed save, on every rank: remove the staging directory (the target is untouched)."""
        _atomic.remove_staging(self.staging)
        self.staging = None
        self.path = self._target

    def _summed(self, results: list[WriteResult]) -> list[WriteResult]:
        """Attach each item's CRC-32 (recorded while writing, see [Note: checksums on the write path])."""
        by_file: dict[str, list[WriteResult]] = defaultdict(list)
        for result in results:
            by_file[result.storage_data.relative_path].append(result)
        summed = []
        for name, in_file in by_file.items():
            path = Path(self.path) / name
            recorded = self.fs.segments.pop(name, {})
            spans = [(r.storage_data.offset, r.storage_data.length) for r in in_file]
            missing = [span for span in spans if span not in recorded]
            recorded.update(zip(missing, crc32_ranges(path, missing), strict=True))
            size = path.stat().st_size
            summed += [dataclasses.replace(r, storage_data=_Summed(r.storage_data, recorded[span], size))
                       for r, span in zip(in_file, spans, strict=True)]
        return summed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest = _manifest_of(results)
        plain = [[dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank] for rank in results]
        staging = Path(self.path)
        try:
            super().finish(metadata, plain)  # writes .metadata into the staging directory, fsynced
            data = (staging / METADATA_NAME).read_bytes()
            manifest.files[METADATA_NAME] = FileEntry(len(data), crc32(data))
            self.manifest_digest = pinned_digest(manifest.write(staging), data)
        except OSError as error:
            full = no_space_error(error, self._target.parent, _ITEM_OVERHEAD * len(manifest.files),
                                  f"the metadata and manifest of {self._target}")
            if full is None:
                raise
            raise full from error
        _atomic.publish(staging, self._target)
        self.staging, self.path = None, self._target
        # After .metadata was written: the returned Metadata (broadcast to every rank) carries the pin.
        metadata.manifest_digest = self.manifest_digest  # type: ignore[attr-defined]  # ours, beside DCP's fields


def _manifest_of(results: list[list[WriteResult]]) -> Manifest:
    items: dict[str, list[ItemSum]] = defaultdict(list)
    sizes: dict[str, int] = {}
    for rank in results:
        for r in rank:
            summed: _Summed = r.storage_data
            items[summed.info.relative_path].append(ItemSum(summed.info.offset, summed.info.length, summed.crc32,
                                                            r.index.fqn))
            sizes[summed.info.relative_path] = summed.file_size
    return Manifest({name: FileEntry(sizes[name], item_table_digest(its), sorted(its, key=lambda i: i.offset))
                     for name, its in items.items()})


class FileSystemReader(_torch_fs.FileSystemReader):
    """PyTorch's ``FileSystemReader`` that verifies before it copies and never runs pickled code.

    Checkpoints with our manifest are checked item by item against it; PyTorch's
    (no manifest) are checked as far as their format allows: every stored item is a
    zip whose records carry a CRC-32, which is verified, and a warning says so.
    Under :func:`tensorplay.distributed.checkpoint.load` nothing is copied until
    every rank has read and verified its share; used directly by PyTorch's ``load``,
    it still copies nothing of a rank's share until all of it verified.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> dcp.save({"weight": tp.ones(2)}, checkpoint_id="ckpt")
        Metadata(...)
        >>> reader = dcp.FileSystemReader("ckpt")
        >>> sorted(reader.read_metadata().state_dict_metadata)
        ['weight']
        >>> state = {"weight": tp.zeros(2)}
        >>> dcp.load(state, storage_reader=reader)
        >>> state["weight"]
        tensor([1., 1.])
    """

    def __init__(self, path: str | os.PathLike, *args: Any, expected_digest: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.expected_digest = expected_digest  # pinned: see [Note: pinning a checkpoint] in _manifest
        self.metadata_error: Exception | None = None  # why the global metadata was refused
        self.manifest: Manifest | None = None
        self.staged: StagedRead | None = None  # set by our load(): commit waits for every rank

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, read bounded ([Note: bounded checkpoint reads]) and without running pickled code.

        PyTorch's ``load`` falls back to a rank's own metadata file when the global one fails; that is only
        right when the global file is missing, so any other failure of it is raised again.
        """
        if kwargs.get("rank") is not None and self.metadata_error is not None:
            raise self.metadata_error
        try:
            return self._read_metadata(kwargs.get("rank"))
        except (CorruptCheckpointError, UnsafeCheckpointError) as error:
            metadata_path = Path(self._get_metadata_path())
            missing = kwargs.get("rank") is None and not metadata_path.exists() and not metadata_path.is_symlink()
            self.metadata_error = None if missing else error
            raise

    def _read_metadata(self, rank: int | None) -> Metadata:
        directory = Path(self.path)
        _atomic.remove_stale(directory, live_saves=True)  # a killed save's leftovers beside this checkpoint
        path = Path(self._get_metadata_path(rank))
        manifest_bytes = _read_manifest(directory)
        self.manifest = (Manifest.from_json(manifest_bytes, str(directory / MANIFEST_NAME))
                         if manifest_bytes is not None else None)
        entry = self.manifest.files.get(path.name) if self.manifest is not None else None
        data = read_capped(resolve_inside(directory, path.name), min(MAX_METADATA_BYTES, entry.size)
                           if entry is not None else MAX_METADATA_BYTES)
        if self.manifest is None:
            warnings.warn(f"{self.path} has no {MANIFEST_NAME} (written by PyTorch's DCP?): its data is checked "
                          f"only against the CRC-32s of its zip records", stacklevel=2)
        else:
            _check_whole_file(self.manifest, path.name, data, path)
        check_pinned(self.expected_digest, manifest_bytes, data, directory)
        metadata = load_metadata(data, path)
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint Metadata")
        _check_storage_infos(metadata, path)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        staged = self.staged if self.staged is not None else StagedRead()
        per_file: dict[str, list] = defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        try:
            for name, items in per_file.items():
                self._stage_file(name, items, planner, staged)
            if self.staged is None:
                staged.commit(planner)
        finally:
            if self.staged is None:
                staged.close()
        return _done(None)

    def _stage_file(self, name: str, items: list, planner: LoadPlanner, staged: StagedRead) -> None:
        path = Path(self.path) / name
        infos = [self.storage_data[item.storage_index] for item in items]
        fqns = sorted({item.storage_index.fqn for item in items})
        resolved = resolve_inside(Path(self.path), name)
        if not resolved.exists() and not resolved.is_symlink():
            raise CorruptCheckpointError(f"{path}: shard file is missing (the metadata stores {fqns[:3]} there)")
        entry = self.manifest.files.get(name) if self.manifest is not None else None
        if self.manifest is not None and entry is None:
            raise CorruptCheckpointError(f"{path}: not listed in the checkpoint manifest")
        open_file = staged.open(resolved)
        size = open_file.stat.st_size
        if entry is not None and size != entry.size:
            raise CorruptCheckpointError(f"{path}: {size} bytes on disk, {entry.size} expected: the file is "
                                         f"truncated or was changed")
        if entry is not None and item_table_digest(entry.items) != entry.digest:
            raise CorruptCheckpointError(f"{path}: its entry in the checkpoint manifest is damaged")
        by_offset = {i.offset: i for i in entry.items} if entry is not None else {}
        for item, info in zip(items, infos, strict=True):  # before anything is allocated or read
            _check_declared(path, item.storage_index.fqn, info, size, by_offset.get(info.offset), entry is not None)
            _check_archive_end(open_file.fd, path, item.storage_index.fqn, info)
        threads = checksum_threads()
        buffer = ItemBuffer()
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        try:
            for item, info in zip(items, infos, strict=True):
                raw = buffer.read(open_file.fd, info.offset, info.length, path)
                if entry is not None:
                    _check_item(path, info, raw, by_offset[info.offset], pool)
                self._stage_item(open_file, item, info, raw, planner, staged)
        finally:
            if pool is not None:
                pool.shutdown()

    def _stage_item(self, open_file: OpenFile, item: Any, info: _StorageInfo, raw: memoryview,
                    planner: LoadPlanner, staged: StagedRead) -> None:
        """Decode one item's stored bytes (already checked) and stage the value, or the place of a plain tensor's
        data (see [Note: all-or-nothing load])."""
        where = f"{open_file.path}: {item.storage_index.fqn!r}"
        stored: IO[bytes] = ViewReader(raw)  # type: ignore[assignment]  # a RawIOBase: a binary file object
        if self.manifest is None:  # no checksums of ours: check the zip records' own CRC-32s
            try:
                check_zip_records(stored, where)
            except DamagedFileError as error:
                raise CorruptCheckpointError(str(error)) from None
        if info.transform_descriptors:
            stored = io.BytesIO(self.transforms.transform_load_stream(item, info.transform_descriptors, stored).read())
        if item.type == LoadItemType.BYTE_IO:
            blob = stored.read()
            decode_blob(io.BytesIO(blob), where)
            staged.blobs.append((item, blob))
            return
        # A foreign byte order is decoded on the CPU, where torch.load converts it ([Note: byte order]).
        plain = not info.transform_descriptors and native_byte_order(stored, where)
        value = decode_tensor(stored, where, meta=plain)
        narrowed = narrow_tensor_by_index(value, item.storage_offsets, item.lengths)
        dest = planner.resolve_tensor(item).detach()
        if dest.size() != narrowed.size():
            raise CorruptCheckpointError(f"{where}: stored shape {tuple(narrowed.size())} does not fit the "
                                         f"destination {tuple(dest.size())}")
        if not plain:
            staged.tensors.append((item, dest, narrowed))
            return
        storage = value.untyped_storage()
        record_offset = getattr(storage, "_checkpoint_offset", None)
        if record_offset is None or record_offset + storage.nbytes() > info.length:
            raise CorruptCheckpointError(f"{where}: its data record lies outside the stored item")
        staged.records.append(Record(item, dest, open_file, info.offset + record_offset, storage.nbytes(), value))


def _check_declared(path: Path, fqn: str, info: _StorageInfo, size: int, want: ItemSum | None,
                    listed: bool) -> None:
    """Refuse an item whose declared bytes are not in the file (or, with a manifest, not an item it lists)."""
    end = info.offset + info.length
    if end > size:
        raise CorruptCheckpointError(f"{path}: {fqn!r} is declared at bytes {info.offset}..{end}, beyond the "
                                     f"file's {size} bytes: the metadata is damaged or the file truncated")
    if listed and (want is None or want.length != info.length):
        raise CorruptCheckpointError(f"{path}: bytes {info.offset}..+{info.length} are not in the manifest")


#: A stored item is a zip: its end-of-archive record lies in its last this many bytes (22 + a comment).
_ARCHIVE_END_BYTES = 22 + (1 << 16)
_ARCHIVE_END = b"PK\x05\x06"


def _check_archive_end(fd: int, path: Path, fqn: str, info: _StorageInfo) -> None:
    """Refuse a large item whose last bytes hold no zip end-of-archive record, before reading all of it
    (declared lengths over a sparse file's hole, say: gigabytes of zeros)."""
    if info.length <= 4 * _ARCHIVE_END_BYTES or info.transform_descriptors:
        return
    tail = os.pread(fd, _ARCHIVE_END_BYTES, info.offset + info.length - _ARCHIVE_END_BYTES)
    if _ARCHIVE_END not in tail:
        raise CorruptCheckpointError(f"{path}: {fqn!r} (bytes {info.offset}..{info.offset + info.length}) does not "
                                     "end as a torch.save archive does (no end-of-archive record): the metadata "
                                     "or the file is damaged")


def _check_item(path: Path, info: _StorageInfo, raw: memoryview, want: ItemSum,
                pool: ThreadPoolExecutor | None) -> None:
    got = crc32_parallel(raw, pool)
    if got != want.crc32:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in {want.fqn!r} (bytes {info.offset}..{info.offset + info.length}): "
            f"CRC-32 {got:#010x}, manifest says {want.crc32:#010x}; the file is damaged")


def _check_storage_infos(metadata: Metadata, source: Path) -> None:
    """Refuse storage entries naming a file outside the directory, a negative offset or length, or items that
    overlap in their file (DCP writes each item once, one after another: one stored as another is a forgery)."""
    per_file: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise CorruptCheckpointError(f"{source}: the storage entry of {getattr(index, 'fqn', index)!r} is "
                                         f"a {type(info).__name__}, not a file range")
        check_storage_name(info.relative_path, source)
        if not (isinstance(info.offset, int) and isinstance(info.length, int)) or info.offset < 0 or info.length < 0:
            raise CorruptCheckpointError(f"{source}: {index.fqn!r} is declared at offset {info.offset!r}, length "
                                         f"{info.length!r}: the metadata is damaged")
        per_file[info.relative_path].append((info.offset, info.length, index.fqn))
    for name, spans in per_file.items():
        spans.sort()
        for (offset, length, fqn), (next_offset, _, next_fqn) in zip(spans, spans[1:], strict=False):
            if offset + length > next_offset:
                raise CorruptCheckpointError(f"{source}: {fqn!r} (bytes {offset}..{offset + length}) and "
                                             f"{next_fqn!r} (from byte {next_offset}) overlap in {name}: the metadata "
                                             "is damaged or forged")


def _read_manifest(directory: Path) -> bytes | None:
    path = directory / MANIFEST_NAME
    if not path.exists() and not path.is_symlink():
        return None
    return read_capped(resolve_inside(directory, MANIFEST_NAME))


def _check_whole_file(manifest: Manifest, name: str, data: bytes, path: Path) -> None:
    entry = manifest.files.get(name)
    if entry is None:
        raise CorruptCheckpointError(f"{path}: not listed in the checkpoint manifest")
    if len(data) != entry.size or crc32(data) != entry.digest:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes with CRC-32 {crc32(data):#010x}, the manifest "
                                     f"says {entry.size} bytes with {entry.digest:#010x}; the file is damaged")


def __getattr__(name: str) -> object:
    """Any other name of PyTorch's ``torch.distributed.checkpoint.filesystem`` (the same object)."""
    import torch.distributed.checkpoint.filesystem as torch_module

    try:
        return getattr(torch_module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
