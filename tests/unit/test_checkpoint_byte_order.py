"""Byte order: files written on a big-endian host load converted (or are refused by name), never as swapped bytes.

The big-endian files are made here on a little-endian host: the values are stored
byte-swapped under a ``byteorder`` record of ``big``, exactly what ``torch.save``
writes on a big-endian machine.
"""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import tensorplay
import tensorplay.distributed.checkpoint as dcp
from tensorplay._serialization import DamagedFileError, stored_byte_order

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed:UserWarning"),
              pytest.mark.skipif(sys.byteorder != "little", reason="the files are made big-endian on a little host")]


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(16, 8, generator=torch.Generator().manual_seed(0)),
            "i": torch.arange(-7, 5, dtype=torch.int64) * 1000003, "h": torch.linspace(-2, 3, 9).half()}


def _swapped(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements with their bytes reversed (what a big-endian host holds in memory for the same values)."""
    size = t.element_size()
    raw = t.contiguous().view(torch.uint8).view(-1, size).flip(-1).contiguous()
    return raw.view(-1).view(t.dtype).view(t.shape)


def _rewritten(data: bytes, byteorder: bytes, swap: torch.dtype | None) -> bytes:
    """A torch.save archive with its ``byteorder`` record replaced (and its data records byte-swapped)."""
    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            record = source.read(info.filename)
            if info.filename.endswith("/byteorder"):
                record = byteorder
            elif "/data/" in info.filename and swap is not None:
                record = _swapped(torch.frombuffer(bytearray(record), dtype=swap)).numpy().tobytes()
            target.writestr(info.filename, record)
    return out.getvalue()


def _big_endian_file(tmp_path: Path, value: torch.Tensor) -> Path:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    path = tmp_path / "big.pt"
    path.write_bytes(_rewritten(buffer.getvalue(), b"big", value.dtype))
    return path


@pytest.mark.parametrize("mmap", [False, True])
def test_a_big_endian_torch_save_file_loads_converted_bitwise(tmp_path, mmap) -> None:
    value = _state()["w"]
    path = _big_endian_file(tmp_path, value)
    with open(path, "rb") as stream:
        assert stored_byte_order(stream, str(path)) == "big"
    assert torch.equal(tensorplay.load(path, mmap=mmap), value)
    assert torch.equal(torch.load(path, mmap=mmap), value)  # PyTorch converts on the CPU too
    assert not torch.equal(_swapped(value), value), "the test must store bytes that differ when not converted"


def test_a_big_endian_file_onto_the_meta_device_is_refused_by_name(tmp_path) -> None:
    path = _big_endian_file(tmp_path, _state()["w"])
    with pytest.raises(ValueError, match=rf"{path}: stored big-endian.*meta device.*map_location='cpu'"):
        tensorplay.load(path, map_location="meta")
    with pytest.raises(ValueError, match="big-endian"):
        tensorplay.load(path, map_location={"cpu": torch.device("meta")})
    # The reference: PyTorch's load onto the meta device crashes the process (it byte-swaps a meta storage).
    crashed = subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(path)!r}, map_location='meta')"],
                             capture_output=True, timeout=120)
    assert crashed.returncode != 0


def test_an_unknown_byte_order_record_is_a_damaged_file_naming_it(tmp_path) -> None:
    buffer = io.BytesIO()
    torch.save(torch.ones(3), buffer)
    path = tmp_path / "odd.pt"
    path.write_bytes(_rewritten(buffer.getvalue(), b"middle", None))
    with pytest.raises(DamagedFileError, match=rf"{path}: records byte order b'middle'"):
        tensorplay.load(path)


def _save_big_endian(state: dict[str, torch.Tensor], root: Path, save, monkeypatch) -> None:
    """Save ``state`` as a big-endian host would: its bytes swapped, under a ``big`` byteorder record."""
    with monkeypatch.context() as patch:
        patch.setattr(sys, "byteorder", "big")
        save({k: _swapped(v) for k, v in state.items()}, checkpoint_id=root, no_dist=True)


@pytest.mark.parametrize("writer", ["ours", "pytorch"])
def test_a_big_endian_dcp_checkpoint_loads_converted_bitwise(tmp_path, monkeypatch, writer) -> None:
    """Ours re-reads verified bytes straight into the model for this host's byte order; a big-endian item must
    go through torch.load's conversion instead (before the fix: swapped values, or a crash decoding onto meta)."""
    state = _state()
    _save_big_endian(state, tmp_path, dcp.save if writer == "ours" else torch_dcp.save, monkeypatch)
    ours = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a PyTorch checkpoint has no manifest
        dcp.load(ours, checkpoint_id=tmp_path, no_dist=True)
    reference = {k: torch.zeros_like(v) for k, v in state.items()}
    torch_dcp.load(reference, checkpoint_id=tmp_path, no_dist=True)
    for key, value in state.items():
        assert torch.equal(ours[key], value), key
        assert torch.equal(reference[key], value), key
