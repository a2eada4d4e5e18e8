"""Fault injection: tensorplay.distributed.checkpoint against PyTorch's DCP on the same damage.

Each case saves a fully_shard model and its Adam state (FQN-keyed DTensors, so
every rank reads only its own shard file), damages the checkpoint, then loads it
into a differently trained model. Ours must be *safe*: every rank raises a
``CheckpointError`` whose message names the damaged file, no rank's model or
optimizer changed by a single bit, and no planted code ran. PyTorch's DCP is the
reference that fails the same property (a silent wrong value, a partial load, an
error on one rank only or naming no file, or code run from the metadata).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import time
import traceback
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.checkpoint
from tensorplay.testing.distributed import run_distributed

MANIFEST = ".tensorplay_manifest.json"
IMPLS = ("ours", "torch")


# ---------------------------------------------------------------- model and state on the ranks

def _dcp(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.checkpoint as dcp
    else:
        import tensorplay.distributed.checkpoint as dcp
    return dcp


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fully_shard MLP after one Adam step (seeded, so every rank builds the same one)."""
    from tensorplay.distributed.fsdp import fully_shard

    tp.manual_seed(seed)
    model = tp.nn.Sequential(tp.nn.Linear(8, 32), tp.nn.ReLU(), tp.nn.Linear(32, 6))
    fully_shard(model)
    opt = tp.optim.Adam(model.parameters(), lr=1e-2)
    x = tp.randn(4, 8, generator=torch.Generator().manual_seed(seed * 100 + dist.get_rank()))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": {fqn: opt.state[p] for fqn, p in model.named_parameters()}}


def local_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, p in model.named_parameters():
        out[fqn] = p.to_local().detach().clone()
        for key, value in opt.state[p].items():
            out[f"{fqn}/{key}"] = (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- damage (run on rank 0 only)

def _item_range(root: Path, file: str, impl_metadata: Any) -> tuple[int, int]:
    """Byte range of the largest tensor item stored in ``file``."""
    infos = [i for i in impl_metadata.storage_data.values() if i.relative_path == file]
    info = max(infos, key=lambda i: i.length)
    return info.offset, info.length


def _read_metadata(root: Path) -> Any:
    with open(root / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, undamaged file


def _update_manifest(root: Path, name: str) -> None:
    """An attacker who edits a file can edit the manifest too: recompute its entry."""
    path = root / MANIFEST
    if path.exists():
        manifest = json.loads(path.read_text())
        data = (root / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "digest": zlib.crc32(data), "items": []}
        path.write_text(json.dumps(manifest))


def truncate(root: Path, marker: Path) -> str:
    name = "__0_0.distcp"
    size = (root / name).stat().st_size
    os.truncate(root / name, size - 100)
    return name


def flip_bit(root: Path, marker: Path) -> str:
    name = "__1_0.distcp"
    offset, length = _item_range(root, name, _read_metadata(root))
    with open(root / name, "r+b") as f:
        f.seek(offset)
        item = f.read(length)
        record = zipfile.ZipFile(io.BytesIO(item)).getinfo(next(n for n in zipfile.ZipFile(io.BytesIO(item)).namelist()
                                                                if n.endswith("data/0")))
        head = record.header_offset
        name_len, extra_len = struct.unpack("<HH", item[head + 26:head + 30])
        at = offset + head + 30 + name_len + extra_len + record.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    return name


def delete_shard(root: Path, marker: Path) -> str:
    name = "__1_0.distcp"
    (root / name).unlink()
    return name


class _Plant:
    """Unpickles by running code that writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def plant_code(root: Path, marker: Path) -> str:
    metadata = _read_metadata(root)
    metadata.planner_data = _Plant(marker)
    (root / ".metadata").write_bytes(pickle.dumps(metadata))
    _update_manifest(root, ".metadata")
    return ".metadata"


DAMAGE = {"truncate": truncate, "flip_bit": flip_bit, "delete_shard": delete_shard, "plant_code": plant_code}


# ---------------------------------------------------------------- one case on every rank

def _try_load(impl: str, root: Path) -> dict[str, Any]:
    model, opt = trained(seed=1)
    before = local_tensors(model, opt)
    outcome: dict[str, Any] = {"error": None, "message": ""}
    try:
        _dcp(impl).load(state_of(model, opt), checkpoint_id=str(root))
    except BaseException as error:  # noqa: BLE001 - PyTorch's CheckpointException is a BaseException
        outcome.update(error=type(error).__name__, message=str(error))
    outcome["unchanged"] = same(before, local_tensors(model, opt))
    return outcome


def fault_case(case: str, root: str) -> dict[str, Any]:
    try:
        out = {}
        for impl in IMPLS:
            path = Path(root) / impl
            model, opt = trained(seed=0)
            _dcp(impl).save(state_of(model, opt), checkpoint_id=str(path))
            dist.barrier()
            marker = Path(root) / f"marker-{impl}"
            if dist.get_rank() == 0:
                out[f"{impl}_file"] = DAMAGE[case](path, marker)
            dist.barrier()
            out[impl] = _try_load(impl, path)
            dist.barrier()
            out[impl]["marker"] = marker.exists()
        return out
    except Exception:  # noqa: BLE001 - reported by the test
        return {"crash": traceback.format_exc()}


def _safe(results: list[dict[str, Any]], impl: str, file: str) -> list[str]:
    """What is wrong with ``impl``'s outcome across the ranks (empty: safe)."""
    problems = []
    for rank, got in enumerate(results):
        outcome = got[impl]
        if outcome["error"] is None:
            problems.append(f"rank {rank} loaded without an error")
        elif file not in outcome["message"]:
            problems.append(f"rank {rank}'s error does not name {file}: {outcome['error']}")
        if not outcome["unchanged"]:
            problems.append(f"rank {rank}'s model or optimizer changed")
        if outcome["marker"]:
            problems.append(f"rank {rank}: code planted in the checkpoint ran")
    return problems


@pytest.mark.parametrize(("case", "world"), [("truncate", 2), ("flip_bit", 2), ("flip_bit", 4),
                                             ("delete_shard", 2), ("delete_shard", 4), ("plant_code", 2)])
def test_damaged_checkpoint_is_an_error_on_every_rank_and_changes_nothing(tmp_path, case, world):
    results = run_distributed(fault_case, case, str(tmp_path), world_size=world, timeout=600)
    for rank, got in enumerate(results):
        assert "crash" not in got, f"rank {rank}:\n{got['crash']}"
    file = results[0]["ours_file"]
    assert _safe(results, "ours", file) == []
    for got in results:
        assert got["ours"]["error"] == "CheckpointError", got["ours"]
    assert _safe(results, "torch", file) != [], "PyTorch's DCP was expected to fail this case (the reference)"


def undamaged_round_trip(root: str) -> dict[str, Any]:
    try:
        out = {}
        for saver in IMPLS:
            model, opt = trained(seed=0)
            saved = local_tensors(model, opt)
            _dcp(saver).save(state_of(model, opt), checkpoint_id=f"{root}/{saver}")
            for loader in IMPLS:
                target, target_opt = trained(seed=1)
                _dcp(loader).load(state_of(target, target_opt), checkpoint_id=f"{root}/{saver}")
                out[f"{loader}_from_{saver}"] = same(saved, local_tensors(target, target_opt))
        return out
    except Exception:  # noqa: BLE001 - reported by the test
        return {"crash": traceback.format_exc()}


def test_undamaged_checkpoints_load_bitwise_both_ways(tmp_path):
    """The control: the same checkpoints undamaged load exactly, ours in PyTorch's DCP and PyTorch's in ours."""
    for rank, got in enumerate(run_distributed(undamaged_round_trip, str(tmp_path), world_size=2)):
        assert "crash" not in got, f"rank {rank}:\n{got['crash']}"
        assert got == {f"{a}_from_{b}": True for b in IMPLS for a in IMPLS}, f"rank {rank}: {got}"


# ---------------------------------------------------------------- a save killed midway

# Put before both saver scripts: after the next item is written, a ``ready`` file and a long sleep.
_STALL_AFTER_WRITE = """
def stall_after_write(ready, seconds):
    import time
    import torch.distributed.checkpoint.filesystem as fs
    write_item = fs._write_item
    def slow_write_item(*args, **kwargs):
        result = write_item(*args, **kwargs)
        open(ready, "w").close()
        time.sleep(seconds)
        return result
    fs._write_item = slow_write_item
"""

_KILLED_SAVE = _STALL_AFTER_WRITE + textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch
    impl, path, ready = sys.argv[1:4]
    if impl == "torch":
        import torch.distributed.checkpoint as dcp
    else:
        import tensorplay.distributed.checkpoint as dcp
    state = lambda value: {"w": torch.full((64, 64), value), "v": torch.full((1000,), value)}
    dcp.save(state(1.0), checkpoint_id=path, no_dist=True)
    stall_after_write(ready, 60)
    dcp.save(state(2.0), checkpoint_id=path, no_dist=True)
""")


def _killed_save(impl: str, root: Path) -> Path:
    path, ready = root / impl, root / f"ready-{impl}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, impl, str(path), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, f"the {impl} saver exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "the saver never reached the write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    return path


def _load_single(impl: str, path: Path, **extra: torch.Tensor) -> dict[str, torch.Tensor] | str:
    """Load ``path`` into one process: ``w``, ``v`` and the ``extra`` entries; the error's text if it fails."""
    state = {"w": torch.zeros(64, 64), "v": torch.zeros(1000), **extra}
    try:
        _dcp(impl).load(state, checkpoint_id=str(path), no_dist=True)
    except BaseException as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return state


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    killed = _killed_save("ours", tmp_path)
    assert any(p.name.startswith(".ours.saving-") for p in tmp_path.iterdir()), "the killed save's staging dir"
    ours = _load_single("ours", killed)
    assert not any(p.name.startswith(".ours.saving-") for p in tmp_path.iterdir()), "the next load removes it"
    assert isinstance(ours, dict), ours
    assert torch.equal(ours["w"], torch.full((64, 64), 1.0)) and torch.equal(ours["v"], torch.full((1000,), 1.0))
    theirs = _load_single("torch", _killed_save("torch", tmp_path))
    previous_intact = isinstance(theirs, dict) and all(bool((t == 1.0).all()) for t in theirs.values())
    assert not previous_intact, "PyTorch's DCP was expected to damage the previous checkpoint (the reference)"


# ---------------------------------------------------------------- one rank killed in a multi-rank save

_RANK_OF_KILLED_SAVE = _STALL_AFTER_WRITE + textwrap.dedent("""
    import os, sys, traceback, warnings
    from datetime import timedelta
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    impl, path, ready, rank, port, outcome = sys.argv[1:7]
    rank = int(rank)
    if impl == "torch":
        import torch.distributed.checkpoint as dcp
    else:
        import tensorplay.distributed.checkpoint as dcp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    state = lambda value: {"w": torch.full((64, 64), value), "v": torch.full((1000,), value),
                           f"own{rank}": torch.full((100,), value + rank)}  # each rank writes one item at least
    dcp.save(state(1.0), checkpoint_id=path)
    dist.barrier()
    if rank == 1:  # rank 1 writes its file, then stalls until it is killed
        stall_after_write(ready, 120)
    try:
        dcp.save(state(2.0), checkpoint_id=path)
        message = "no error"
    except BaseException as error:
        message = f"{type(error).__name__}: {error}"
    with open(outcome, "w") as f:
        f.write(message)
    os._exit(0)
""")


def _kill_rank_one_mid_save(impl: str, root: Path) -> tuple[Path, str | None]:
    """Two ranks save a checkpoint, then a second one; rank 1 is SIGKILLed after writing its data. Returns the
    checkpoint path and what rank 0's save raised (None: still blocked after 150 s, then killed). The start-up
    deadline is generous: two fresh interpreters import torch and save once on a loaded machine."""
    from tensorplay.testing.distributed import free_port
    path, ready, outcome = root / impl, root / f"ready-{impl}", root / f"outcome-{impl}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_OF_KILLED_SAVE, impl, str(path), str(ready), str(rank),
                               port, str(outcome)], env=env) for rank in range(2)]
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert all(p.poll() is None for p in procs), f"a {impl} rank exited early"
            assert time.monotonic() < deadline, "rank 1 never reached its write"
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        try:
            procs[0].wait(timeout=150)
        except subprocess.TimeoutExpired:
            return path, None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return path, outcome.read_text() if outcome.exists() else None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rank_killed_in_a_multi_rank_save_leaves_the_previous_checkpoint_and_the_other_rank_raises(tmp_path):
    path, raised = _kill_rank_one_mid_save("ours", tmp_path)
    assert raised is not None, "rank 0 hung after rank 1 died"
    assert raised.startswith("CheckpointError") and "rank(s)" in raised, raised
    loaded = _load_single("ours", path, own1=torch.zeros(100))
    assert isinstance(loaded, dict), loaded
    assert torch.equal(loaded["w"], torch.full((64, 64), 1.0)) and torch.equal(loaded["v"], torch.full((1000,), 1.0))
    assert torch.equal(loaded["own1"], torch.full((100,), 2.0))
    # The reference: PyTorch's DCP overwrites in place, so rank 0's new data sits beside the old metadata.
    theirs_path, theirs_raised = _kill_rank_one_mid_save("torch", tmp_path)
    theirs = _load_single("torch", theirs_path, own1=torch.zeros(100))
    previous_intact = isinstance(theirs, dict) and all(bool((t == (2.0 if k == "own1" else 1.0)).all())
                                                       for k, t in theirs.items())
    assert not previous_intact, f"PyTorch's DCP was expected to damage the previous checkpoint: {theirs_raised}"


# ---------------------------------------------------------------- tp.save / tp.load

def _flip_in_record(path: Path, record_suffix: str) -> None:
    data = bytearray(path.read_bytes())
    archive = zipfile.ZipFile(io.BytesIO(bytes(data)))
    info = archive.getinfo(next(n for n in archive.namelist() if n.endswith(record_suffix)))
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_tp_load_refuses_a_flipped_bit_that_torch_load_returns(tmp_path):
    path = tmp_path / "x.pt"
    value = {"w": torch.arange(256, dtype=torch.float32)}
    tp.save(value, path)
    assert torch.equal(tp.load(path)["w"], value["w"])
    _flip_in_record(path, "data/0")
    with pytest.raises(ValueError, match=r"x\.pt.*record '.*data/0'.*CRC"):
        tp.load(path)
    assert not torch.equal(torch.load(path)["w"], value["w"])  # the reference: a silent wrong value


def test_tp_load_refuses_a_truncated_file(tmp_path):
    path = tmp_path / "x.pt"
    tp.save({"w": torch.ones(1000)}, path)
    data = path.read_bytes()
    for cut in (len(data) - 10, len(data) // 2):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"x\.pt.*truncated"):
            tp.load(path)


def test_tp_load_is_weights_only_by_default(tmp_path):
    path, marker = tmp_path / "x.pt", tmp_path / "marker"
    torch.save({"w": _Plant(marker)}, path)
    with pytest.raises(pickle.UnpicklingError):
        tp.load(path)
    assert not marker.exists()
