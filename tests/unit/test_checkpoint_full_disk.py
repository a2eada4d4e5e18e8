"""A full disk: the save says "no space left on <path>: needed ~N bytes" and leaves nothing behind.

On a real full filesystem (a 1 MiB tmpfs, where this process may mount one) and
with ENOSPC injected into the writer (everywhere else). A killed save's leftovers
beside a checkpoint go at the next save or load of it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed.checkpoint as dcp
from tensorplay.distributed.checkpoint import CheckpointError

from tests.common import disk_full_after

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

BIG = {"w": torch.arange(512 * 1024, dtype=torch.float32)}  # 2 MiB: more than the tmpfs holds
SMALL = {"w": torch.arange(16, dtype=torch.float32)}


@contextlib.contextmanager
def _tmpfs(directory: Path, size: str = "1m") -> Iterator[Path]:
    directory.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"cannot mount a tmpfs here ({error})")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True, timeout=30)


def _cause(error: CheckpointError) -> BaseException:
    (exc, _trace), = error.failures.values()
    return exc


def test_dcp_save_into_a_full_tmpfs_names_it_and_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "disk") as disk:
        dcp.save(SMALL, checkpoint_id=disk / "latest")
        with pytest.raises(CheckpointError) as info:
            dcp.save(BIG, checkpoint_id=disk / "latest")
        cause = _cause(info.value)
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
        assert str(cause).startswith(f"[Errno 28] no space left on {disk}: needed ~2098176 bytes for this rank's "
                                     f"files (1 items) of {disk / 'latest'}, ")
        assert sorted(p.name for p in disk.iterdir()) == ["latest"]  # no .latest.saving-* left
        loaded = {"w": torch.zeros(16)}
        dcp.load(loaded, checkpoint_id=disk / "latest")
        assert torch.equal(loaded["w"], SMALL["w"])


def test_tp_save_into_a_full_tmpfs_names_it_and_leaves_nothing(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "disk") as disk:
        with pytest.raises(OSError, match=rf"no space left on {disk}: needed ~209\d{{4}} bytes for "
                                          rf"{disk / 'model.pt'}, \d+ bytes free"):
            tp.save(BIG, disk / "model.pt")
        assert list(disk.iterdir()) == []


def test_enospc_from_the_writer_is_named_and_the_staging_directory_goes(tmp_path: Path, monkeypatch) -> None:
    from tensorplay.distributed.checkpoint import _write_checksums

    real_write = _write_checksums.ChecksummingStream.write
    monkeypatch.setattr(_write_checksums.ChecksummingStream, "write", disk_full_after(real_write))
    with pytest.raises(CheckpointError) as info:
        dcp.save(BIG, checkpoint_id=tmp_path / "ckpt")
    assert str(_cause(info.value)).startswith(f"[Errno 28] no space left on {tmp_path}: needed ~2098176 bytes")
    assert list(tmp_path.iterdir()) == []


def test_a_short_write_on_a_filesystem_without_room_is_named(tmp_path: Path, monkeypatch) -> None:
    """torch.save's own report of a short write (no errno) with no room left on the filesystem."""
    import tensorplay._disk_space as disk_space
    from tensorplay.distributed.checkpoint import _write_checksums

    def write(self, data):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(_write_checksums.ChecksummingStream, "write", write)
    monkeypatch.setattr(disk_space, "free_bytes", lambda directory: 100)
    with pytest.raises(CheckpointError) as info:
        dcp.save(BIG, checkpoint_id=tmp_path / "ckpt")
    assert str(_cause(info.value)) == (f"[Errno 28] no space left on {tmp_path}: needed ~2098176 bytes for this "
                                       f"rank's files (1 items) of {tmp_path / 'ckpt'}, 100 bytes free")
    monkeypatch.setattr(disk_space, "free_bytes", lambda directory: 1 << 40)  # room left: not a full disk
    with pytest.raises(CheckpointError, match="unexpected pos 704 vs 598"):
        dcp.save(BIG, checkpoint_id=tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_tp_save_names_an_enospc_from_fsync(tmp_path: Path, monkeypatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match=rf"no space left on {tmp_path}: needed ~\d+ bytes for {tmp_path / 'm.pt'}"):
        tp.save(SMALL, tmp_path / "m.pt")
    assert list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_saves_leftovers_go_at_the_next_load_and_save(tmp_path: Path) -> None:
    root = tmp_path / "latest"
    dcp.save(SMALL, checkpoint_id=root)
    host = socket.gethostname()
    dead = tmp_path / f".latest.saving-0123456789ab-{_dead_pid()}-{host}"
    live = tmp_path / f".latest.saving-ba9876543210-{os.getpid()}-{host}"  # a save in progress elsewhere
    old = tmp_path / ".latest.old-0123456789ab"
    for leftover in (dead, live, old):
        leftover.mkdir()
        (leftover / "__0_0.distcp").write_bytes(b"x" * 100)
    dcp.load({"w": torch.zeros(16)}, checkpoint_id=root)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "latest"])
    dcp.save(SMALL, checkpoint_id=root)  # a save of this root owns it: every leftover goes
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".latest.old-")) == ["latest"]


def test_an_async_save_into_a_full_disk_fails_as_save_does(tmp_path: Path, monkeypatch) -> None:
    from tensorplay.distributed.checkpoint import _write_checksums

    real_write = _write_checksums.ChecksummingStream.write
    monkeypatch.setattr(_write_checksums.ChecksummingStream, "write", disk_full_after(real_write))
    future = dcp.async_save(BIG, checkpoint_id=tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=rf"saving checkpoint {tmp_path / 'ckpt'} failed on rank\(s\) 0") as info:
        future.result(timeout=60)
    assert str(_cause(info.value)).startswith(f"[Errno 28] no space left on {tmp_path}: needed ~2098176 bytes")
    assert list(tmp_path.iterdir()) == []  # no .ckpt.saving-* left
    monkeypatch.setattr(_write_checksums.ChecksummingStream, "write", real_write)
    dcp.async_save(SMALL, checkpoint_id=tmp_path / "ckpt").result(timeout=60)  # room again: the next one lands
    loaded = {"w": torch.zeros(16)}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(loaded["w"], SMALL["w"])
