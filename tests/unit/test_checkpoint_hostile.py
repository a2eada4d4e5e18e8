"""Hostile checkpoints: every load is bounded by the files' sizes and reads nothing outside the directory.

Each case is a file an adversary or a damaged disk could hand ``dcp.load`` or
``tp.load``; PyTorch's loaders read some of them whole, allocate what they declare,
or read a file outside the checkpoint. Ours must refuse each with an error naming
the file and leave the state dict untouched ([Note: bounded checkpoint reads]).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorplay as tp
import tensorplay.distributed.checkpoint as dcp
from tensorplay._zip_records import DamagedFileError
from tensorplay.distributed.checkpoint import CheckpointError
from tensorplay.testing.checkpoint_damage import (
    KINDS,
    add_bomb_record,
    damage,
    overlapping_records,
    read_metadata,
    recompute_manifest,
    write_metadata,
)

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed:UserWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

MANIFEST = ".tensorplay_manifest.json"


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.arange(7.0)}


def _zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64, 64), "b": torch.zeros(7)}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    dcp.save(_state(), checkpoint_id=tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def allocated(monkeypatch) -> list[int]:
    """The lengths of the item buffers the load allocates."""
    from tensorplay.distributed.checkpoint import _item_reader

    lengths: list[int] = []
    real_read = _item_reader.ItemBuffer.read
    monkeypatch.setattr(_item_reader.ItemBuffer, "read", lambda self, fd, offset, length, path: lengths.append(
        length) or real_read(self, fd, offset, length, path))
    return lengths


def _refused(root: Path, cause: type, match: str, **load_kwargs: object) -> None:
    """Loading ``root`` raises a CheckpointError whose rank-0 cause is ``cause`` matching ``match``; no copy."""
    target = _zeros()
    with pytest.raises(CheckpointError) as info:
        dcp.load(target, checkpoint_id=root, **load_kwargs)
    exc = info.value.failures[0][0]
    assert isinstance(exc, cause), repr(exc)
    assert re.search(match, str(exc)), str(exc)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in target.values())


@pytest.mark.parametrize("name", [".metadata", MANIFEST])
def test_metadata_or_manifest_linked_to_dev_zero_is_refused_unread(ckpt: Path, name: str) -> None:
    (ckpt / name).unlink()
    (ckpt / name).symlink_to("/dev/zero")
    _refused(ckpt, dcp.UnsafeCheckpointError, rf"{name}: resolves to /dev/zero, outside the checkpoint directory")


def test_a_fifo_as_metadata_is_refused_without_blocking(ckpt: Path) -> None:
    (ckpt / ".metadata").unlink()
    os.mkfifo(ckpt / ".metadata")
    _refused(ckpt, dcp.UnsafeCheckpointError, r"\.metadata: is not a regular file")


def test_metadata_larger_than_the_cap_is_refused_before_reading(ckpt: Path) -> None:
    (ckpt / MANIFEST).unlink()  # PyTorch-style: no manifest to bound it by
    os.truncate(ckpt / ".metadata", 2 << 30)  # sparse: 2 GiB declared, nothing on disk
    _refused(ckpt, dcp.CorruptCheckpointError, r"\.metadata: holds 2147483648 bytes, more than the 1073741824 "
                                               r"expected")


@pytest.mark.parametrize("manifest", ["recomputed", "absent"])
def test_an_item_declaring_more_than_its_file_holds_is_refused_before_allocating(ckpt: Path, manifest: str,
                                                                              allocated: list[int]) -> None:
    metadata = read_metadata(ckpt)
    index = max(metadata.storage_data, key=lambda i: metadata.storage_data[i].offset)  # the file's last item
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], length=2 << 30)
    write_metadata(ckpt, metadata)
    if manifest == "absent":
        (ckpt / MANIFEST).unlink()
    _refused(ckpt, dcp.CorruptCheckpointError, rf"__0_0\.distcp: '{index.fqn}' is declared at bytes \d+\.\.2147\d+, "
                                               r"beyond the file's \d+ bytes")
    assert all(n < 1 << 20 for n in allocated), allocated


def test_items_stored_over_one_another_are_refused(ckpt: Path) -> None:
    """An adversary points one tensor's entry at another's bytes (same shape) and recomputes the manifest."""
    state = {"a": torch.arange(64.0), "b": torch.arange(64.0) * -1}
    dcp.save(state, checkpoint_id=ckpt)
    metadata = read_metadata(ckpt)
    a, b = (next(i for i in metadata.storage_data if i.fqn == n) for n in ("a", "b"))
    metadata.storage_data[b] = metadata.storage_data[a]
    write_metadata(ckpt, metadata)
    target = {"a": torch.zeros(64), "b": torch.zeros(64)}
    with pytest.raises(CheckpointError, match=r"\.metadata: '[ab]' \(bytes \d+\.\.\d+\) and '[ab]' \(from byte \d+\) "
                                              r"overlap in __0_0\.distcp: the metadata is damaged or forged"):
        dcp.load(target, checkpoint_id=ckpt)
    assert torch.equal(target["b"], torch.zeros(64))


def test_an_item_declared_over_a_sparse_hole_is_refused_before_it_is_read(ckpt: Path, allocated: list[int]) -> None:
    """The file really is that long (a hole of zeros) and the manifest agrees: the item's end is not a zip."""
    metadata = read_metadata(ckpt)
    index = max(metadata.storage_data, key=lambda i: metadata.storage_data[i].offset)
    info = metadata.storage_data[index]
    os.truncate(ckpt / info.relative_path, info.offset + (8 << 20))
    metadata.storage_data[index] = dataclasses.replace(info, length=8 << 20)
    write_metadata(ckpt, metadata)
    _refused(ckpt, dcp.CorruptCheckpointError, rf"__0_0\.distcp: '{index.fqn}' \(bytes \d+\.\.\d+\) does not end as a "
                                               r"torch\.save archive does \(no end-of-archive record\)")
    assert all(n < 1 << 20 for n in allocated), allocated


@pytest.mark.parametrize("where", ["../outside/__0_0.distcp", "absolute", "sub/../../outside/__0_0.distcp"])
def test_a_storage_path_outside_the_directory_is_refused(ckpt: Path, where: str) -> None:
    outside = ckpt.parent / "outside"
    outside.mkdir()
    shutil.copy(ckpt / "__0_0.distcp", outside / "__0_0.distcp")
    path = str(outside / "__0_0.distcp") if where == "absolute" else where
    metadata = read_metadata(ckpt)
    metadata.storage_data = {i: dataclasses.replace(info, relative_path=path)
                             for i, info in metadata.storage_data.items()}
    write_metadata(ckpt, metadata)
    _refused(ckpt, dcp.UnsafeCheckpointError, rf"\.metadata: stores data at '{path}', outside the checkpoint "
                                              "directory")


def test_a_shard_linked_to_a_file_outside_the_directory_is_refused(ckpt: Path) -> None:
    outside = ckpt.parent / "elsewhere.distcp"
    shutil.copy(ckpt / "__0_0.distcp", outside)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(outside)
    _refused(ckpt, dcp.UnsafeCheckpointError, rf"__0_0\.distcp: resolves to {outside}, outside the checkpoint")


def test_a_shard_linked_inside_the_directory_still_loads(ckpt: Path) -> None:
    os.rename(ckpt / "__0_0.distcp", ckpt / "__0_0.distcp.real")
    (ckpt / "__0_0.distcp").symlink_to("__0_0.distcp.real")
    target = _zeros()
    dcp.load(target, checkpoint_id=ckpt)
    assert torch.equal(target["w"], _state()["w"])


def test_save_returns_a_pin_that_load_checks(ckpt: Path) -> None:
    metadata = dcp.save(_state(), checkpoint_id=ckpt)
    pin = metadata.manifest_digest
    assert isinstance(pin, str) and len(pin) == 64
    target = _zeros()
    dcp.load(target, checkpoint_id=ckpt, expected_digest=pin)
    assert torch.equal(target["b"], _state()["b"])
    # An adversary puts other values in the shard and recomputes the manifest: it loads, unpinned ...
    other = ckpt.parent / "other"
    dcp.save({k: v * 2 for k, v in _state().items()}, checkpoint_id=other)
    shutil.copy(other / "__0_0.distcp", ckpt / "__0_0.distcp")
    recompute_manifest(ckpt)
    changed = _zeros()
    dcp.load(changed, checkpoint_id=ckpt)
    assert torch.equal(changed["w"], _state()["w"] * 2)
    # ... and is refused pinned.
    _refused(ckpt, dcp.CorruptCheckpointError, rf"hash to [0-9a-f]{{64}}, the pinned expected_digest is {pin}: "
                                               "this is not the checkpoint that was saved", expected_digest=pin)
    with pytest.raises(ValueError, match=r"load\(expected_digest=\.\.\.\) needs tensorplay's FileSystemReader, which "
                                         r"checks the pin; the storage_reader is a torch\.distributed\.checkpoint"):
        dcp.load(_zeros(), storage_reader=torch.distributed.checkpoint.FileSystemReader(ckpt),
                 expected_digest=pin)


def test_a_pinned_load_of_a_checkpoint_without_manifest_is_refused(ckpt: Path) -> None:
    pin = dcp.save(_state(), checkpoint_id=ckpt).manifest_digest
    (ckpt / MANIFEST).unlink()
    _refused(ckpt, dcp.CorruptCheckpointError, "has no .tensorplay_manifest.json, so it cannot be the checkpoint "
                                               "pinned", expected_digest=pin)


# ---------------------------------------------------------------- tp.load


def test_tp_load_does_not_decompress_a_record_torch_load_never_reads(tmp_path: Path) -> None:
    """A deflated extra record with a wrong CRC: checking it would decompress 64 MiB and raise."""
    path = tmp_path / "model.pt"
    tp.save({"w": torch.arange(10.0)}, path)
    add_bomb_record(path, 64 << 20, damaged=True)
    assert torch.equal(tp.load(path)["w"], torch.load(path)["w"])


def test_tp_load_still_checks_a_compressed_record_torch_load_reads(tmp_path: Path) -> None:
    import struct
    import zipfile

    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(10.0)}, path)
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info))
    data = bytearray((tmp_path / "deflated.pt").read_bytes())
    at = data.index(b"PK\x01\x02")
    while not bytes(data[at + 46:at + 46 + struct.unpack_from("<H", data, at + 28)[0]]).endswith(b"data/0"):
        at = data.index(b"PK\x01\x02", at + 4)
    data[at + 16] ^= 0x01  # the record's CRC-32 in the central directory, which zipfile checks
    (tmp_path / "deflated.pt").write_bytes(bytes(data))
    assert torch.equal(torch.load(tmp_path / "deflated.pt")["w"], torch.arange(10.0))  # PyTorch checks no CRC
    with pytest.raises(DamagedFileError, match=r"deflated\.pt: record '[^']*data/0' is damaged"):
        tp.load(tmp_path / "deflated.pt")


def test_tp_load_refuses_overlapping_records(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(10.0)}, path)
    path.write_bytes(overlapping_records(path.read_bytes(), 50))
    with pytest.raises(DamagedFileError, match=r"model\.pt: record '[^']+' declares \d+ bytes, which run into "
                                               r"record '[^']+dup\d+_*' at byte \d+: the records overlap"):
        tp.load(path)


def test_tp_load_refuses_a_stored_record_whose_sizes_disagree(tmp_path: Path) -> None:
    import struct
    import zipfile

    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(10.0)}, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    entry = data.index(b"PK\x01\x02")
    struct.pack_into("<I", data, entry + 24, 1 << 31)  # the first record's unstored size
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match=rf"record '{names[0]}' is damaged: stored uncompressed, but it "
                                               r"declares \d+ bytes stored and 2147483648 unstored"):
        tp.load(path)


# ---------------------------------------------------------------- random damage (the fuzz bench's subset)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(sorted(KINDS)))
def test_random_damage_is_refused_or_loads_the_saved_values(tmp_path_factory, seed: int, kind: str) -> None:
    root = tmp_path_factory.mktemp("fuzz") / "ckpt"
    dcp.save(_state(), checkpoint_id=root)
    what = damage(root, random.Random(seed), kind)
    target = _zeros()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(target, checkpoint_id=root)
        except CheckpointError as error:
            causes = [exc for exc, _ in error.failures.values()]
            assert all(isinstance(c, (dcp.CorruptCheckpointError, dcp.UnsafeCheckpointError)) for c in causes), \
                (what, causes)
            assert all(torch.equal(v, torch.zeros_like(v)) for v in target.values()), what
            return
    saved = _state()
    assert all(torch.equal(target[k], saved[k]) for k in saved), what  # nothing changed that a value depends on


def test_recompute_manifest_matches_the_saved_one(ckpt: Path) -> None:
    before = (ckpt / MANIFEST).read_bytes()
    recompute_manifest(ckpt)
    import json
    assert json.loads((ckpt / MANIFEST).read_bytes())["files"] == json.loads(before)["files"]
