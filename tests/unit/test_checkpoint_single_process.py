"""tensorplay.distributed.checkpoint in one process: reading PyTorch's checkpoints, replacing, refusing."""

from __future__ import annotations

import io
import os
import pickle
import struct
import threading
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import tensorplay.distributed.checkpoint as dcp
from tensorplay.distributed.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from tensorplay.distributed.checkpoint._safe_unpickle import load_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed:UserWarning")


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((16, 8), value), "b": torch.arange(5.0) * value}


def _zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(16, 8), "b": torch.zeros(5)}


def _flip_tensor_byte(root: Path, fqn: str) -> str:
    """Flip one bit inside ``fqn``'s stored tensor bytes; return the file's name."""
    with open(root / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == fqn)
    path = root / info.relative_path
    data = bytearray(path.read_bytes())
    item = bytes(data[info.offset:info.offset + info.length])
    archive = zipfile.ZipFile(io.BytesIO(item))
    record = archive.getinfo(next(n for n in archive.namelist() if n.endswith("data/0")))
    name_len, extra_len = struct.unpack("<HH", item[record.header_offset + 26:record.header_offset + 30])
    data[info.offset + record.header_offset + 30 + name_len + extra_len + 3] ^= 0x40
    path.write_bytes(bytes(data))
    return info.relative_path


def test_pytorch_checkpoint_loads_with_a_warning(tmp_path):
    torch_dcp.save(_state(2.0), checkpoint_id=tmp_path, no_dist=True)
    state = _zeros()
    with pytest.warns(UserWarning, match="no .tensorplay_manifest.json"):
        dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in _state(2.0).items())


def test_pytorch_checkpoint_with_a_flipped_bit_is_refused_by_its_zip_crc(tmp_path):
    torch_dcp.save(_state(2.0), checkpoint_id=tmp_path, no_dist=True)
    name = _flip_tensor_byte(tmp_path, "w")
    state = _zeros()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=rf"{name}.*'w'.*CRC-32") as error:
            dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
        torch_state = _zeros()
        torch_dcp.load(torch_state, checkpoint_id=tmp_path, no_dist=True)  # the reference: loads silently
    assert isinstance(error.value.failures[0][0], CorruptCheckpointError)
    assert all(not v.any() for v in state.values()), "nothing may be copied"
    assert not torch.equal(torch_state["w"], _state(2.0)["w"])


def test_save_replaces_a_previous_checkpoint_atomically_and_leaves_no_staging_dirs(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save(_state(1.0), checkpoint_id=path, no_dist=True)
    dcp.save(_state(3.0), checkpoint_id=path, no_dist=True)
    state = _zeros()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert torch.equal(state["w"], _state(3.0)["w"])
    # The replaced checkpoint is deleted on a background thread: wait for it, then nothing else is left.
    for thread in threading.enumerate():
        if thread.name == "tensorplay-checkpoint-cleanup":
            thread.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    torch_state = _zeros()
    torch_dcp.load(torch_state, checkpoint_id=path, no_dist=True)  # ours load in PyTorch's DCP
    assert torch.equal(torch_state["b"], _state(3.0)["b"])


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path):
    dcp.save(_state(1.0), checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(CheckpointError, match="already exists"):
        dcp.save(_state(2.0), storage_writer=dcp.FileSystemWriter(tmp_path, overwrite=False), no_dist=True)


def test_async_save_publishes_a_loadable_checkpoint(tmp_path):
    future = dcp.async_save(_state(4.0), checkpoint_id=tmp_path / "a", no_dist=True)
    future.result()
    state = _zeros()
    dcp.load(state, checkpoint_id=tmp_path / "a", no_dist=True)
    assert torch.equal(state["w"], _state(4.0)["w"])


def test_wrong_shape_is_an_error_and_nothing_is_copied(tmp_path):
    dcp.save(_state(1.0), checkpoint_id=tmp_path, no_dist=True)
    state = {"b": torch.zeros(5), "w": torch.zeros(16, 9)}
    with pytest.raises(CheckpointError):
        dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    assert not state["b"].any() and not state["w"].any()


def test_metadata_allow_list_names_the_class_and_the_file():
    payload = pickle.dumps(os.system)
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt/\.metadata.*system"):
        load_metadata(payload, "ckpt/.metadata")
    with pytest.raises(CorruptCheckpointError, match=r"ckpt/\.metadata"):
        load_metadata(payload[:-3], "ckpt/.metadata")


def test_damaged_manifest_is_an_error(tmp_path):
    dcp.save(_state(1.0), checkpoint_id=tmp_path, no_dist=True)
    (tmp_path / ".tensorplay_manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest is damaged"):
        dcp.load(_zeros(), checkpoint_id=tmp_path, no_dist=True)


def test_save_refuses_to_replace_a_directory_holding_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt.*directory of its own"):
        dcp.save(_state(1.0), checkpoint_id=tmp_path, no_dist=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_manifest_crcs_recorded_while_writing_match_the_bytes_on_disk(tmp_path):
    from tensorplay.distributed.checkpoint._manifest import (
        Manifest,
        crc32_ranges,
        item_table_digest,
    )

    dcp.save({**_state(1.0), "note": "text", "n": 3}, checkpoint_id=tmp_path, no_dist=True)
    manifest = Manifest.read(tmp_path)
    data_files = {name: e for name, e in manifest.files.items() if name.endswith(".distcp")}
    assert data_files and sum(len(e.items) for e in data_files.values()) == 4
    for name, entry in data_files.items():
        assert crc32_ranges(tmp_path / name, [(i.offset, i.length) for i in entry.items]) == [i.crc32 for i in
                                                                                          entry.items]
        assert entry.digest == item_table_digest(entry.items) and entry.size == (tmp_path / name).stat().st_size


def test_module_paths_of_pytorchs_dcp_resolve_to_ours_or_pytorchs_objects():
    import torch.distributed.checkpoint.filesystem as torch_fs

    from tensorplay.distributed.checkpoint import (
        default_planner,
        filesystem,
        metadata,
        state_dict,
        stateful,
    )

    assert filesystem.FileSystemWriter is dcp.FileSystemWriter
    assert filesystem.FileSystemWriter is not torch_fs.FileSystemWriter
    assert filesystem._StorageInfo is torch_fs._StorageInfo
    assert filesystem.SerializationFormat is torch_fs.SerializationFormat
    assert default_planner.DefaultLoadPlanner is torch_dcp.DefaultLoadPlanner
    assert metadata.Metadata is torch_dcp.Metadata
    assert stateful.Stateful is torch_dcp.stateful.Stateful
    assert state_dict.StateDictOptions is torch_dcp.state_dict.StateDictOptions
    assert state_dict.get_state_dict.__module__ == "tensorplay.distributed.checkpoint.state_dict"


def test_crc32_combine_and_parallel_match_zlib() -> None:
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    from tensorplay._crc32 import crc32, crc32_combine, crc32_parallel
    for n in (0, 1, 15, 64, 4097, 1 << 20):  # the fast CRC is zlib's CRC-32, whatever computes it
        data = bytearray(os.urandom(n))
        assert crc32(data) == zlib.crc32(data) and crc32(memoryview(data), 99) == zlib.crc32(data, 99), n
    for la, lb in [(0, 0), (1, 0), (0, 5), (13, 1000), (100_000, 7), (5, 3 << 20)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b), (la, lb)
    data = memoryview(os.urandom(9 << 20 | 123))
    with ThreadPoolExecutor(3) as pool:
        assert crc32_parallel(data, pool, 77) == zlib.crc32(data, 77)


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_zip_record_check_finds_a_flipped_bit_stored_or_compressed(compression) -> None:
    from tensorplay._zip_records import DamagedFileError, check_zip_records
    payload = bytes(range(256)) * 64
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        archive.writestr("a/data/0", payload)
        archive.writestr("a/data/1", payload[::-1])
    check_zip_records(io.BytesIO(buffer.getvalue()), "x.pt")  # intact: no error
    info = zipfile.ZipFile(io.BytesIO(buffer.getvalue())).getinfo("a/data/1")
    damaged = bytearray(buffer.getvalue())
    name_len, extra_len = struct.unpack("<HH", damaged[info.header_offset + 26:info.header_offset + 30])
    damaged[info.header_offset + 30 + name_len + extra_len + info.compress_size // 2] ^= 0x10
    with pytest.raises(DamagedFileError, match=r"x\.pt: record 'a/data/1' is damaged"):
        check_zip_records(io.BytesIO(bytes(damaged)), "x.pt")


@pytest.mark.parametrize("torch_crc", [True, False])
def test_manifest_crcs_cover_the_bytes_whether_or_not_torch_computed_them(tmp_path, torch_crc) -> None:
    """Large records take torch.save's own CRC from the zip data descriptor; with PyTorch's CRCs switched off
    they are read back. Either way every recorded CRC is that of the item's bytes on disk."""
    import zlib

    from tensorplay.distributed.checkpoint._manifest import Manifest
    state = {"big": torch.randn(700, 1024), "small": torch.randn(3), "step": 5}
    torch.serialization.set_crc32_options(torch_crc)
    try:
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    finally:
        torch.serialization.set_crc32_options(True)
    manifest = Manifest.read(tmp_path)
    assert manifest is not None
    checked = 0
    for name, entry in manifest.files.items():
        data = (tmp_path / name).read_bytes()
        for item in entry.items:
            assert zlib.crc32(data[item.offset:item.offset + item.length]) == item.crc32, (name, item.fqn)
            checked += 1
    assert checked == 3
    loaded = {"big": torch.zeros(700, 1024), "small": torch.zeros(3), "step": 0}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(loaded["big"], state["big"]) and loaded["step"] == 5


def test_commit_refuses_a_file_changed_after_its_verification(tmp_path) -> None:
    """Verified tensor bytes are re-read at commit from the same open file: a changed file copies nothing."""
    from tensorplay.distributed.checkpoint._staged_read import StagedRead
    path = tmp_path / "data"
    path.write_bytes(b"x" * 64)
    staged = StagedRead()
    try:
        staged.open(path)
        with open(path, "ab") as f:
            f.write(b"y")
        with pytest.raises(CorruptCheckpointError, match="changed on disk between its verification and the copy"):
            staged.commit(planner=None)  # type: ignore[arg-type]  # refused before the planner is used
    finally:
        staged.close()


def test_dropping_the_replaced_checkpoints_cache_keeps_its_files(tmp_path) -> None:
    from tensorplay.distributed.checkpoint._atomic import drop_cached

    state = {"w": torch.arange(4096, dtype=torch.float32)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    files = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    drop_cached(tmp_path / "ckpt", "__0_")
    drop_cached(tmp_path / "absent", "__0_")  # nothing to replace: no error
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == files
    loaded = {"w": torch.zeros(4096)}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(loaded["w"], state["w"])
