"""Hostile and damaged checkpoints: what each load costs (peak RSS, time) and the error it gives, ours and PyTorch's.

A real checkpoint (an MLP's state dict and its Adam state, one rank, ``dcp.save``) is
damaged in named hostile ways (issue 41's list: ``.metadata`` or the manifest linked
to ``/dev/zero``, an item declaring 2 GiB, a storage path outside the directory, a
shard linked outside it; ``tp.load`` of a file with a record deflated from 2 GiB or
with overlapping records), then ``--count`` times at random
(``tensorplay.testing.checkpoint_damage``: truncation, bit flips, size fields in
``.metadata`` and in the zip records, symlinks, path fields). Each load runs in a
process forked for it (a 4 GiB address-space cap, killed after 60 s); its peak RSS
is the child's ``ru_maxrss`` less an idle forked child's, its time the child's wall
time (on a shared machine). The bound each random load must keep: a peak RSS over
idle no more than an intact load's (the largest of 5) plus 2 x the checkpoint's size, and a second.

    .venv/bin/python bench/bench_checkpoint_fuzz.py [--count 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pickle
import random
import resource
import shutil
import signal
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed.checkpoint as dcp
from tensorplay.testing.checkpoint_damage import (
    KINDS,
    add_bomb_record,
    damage,
    overlapping_records,
    read_metadata,
    write_metadata,
)

_CAP_BYTES = 4 << 30
_KILL_S = 60.0


def _model_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": {f"{n}.{k}": v for n, p in model.named_parameters()
                                                   for k, v in opt.state[p].items()}}


def _target(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {k: torch.zeros_like(v) for k, v in state["optim"].items()}}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[g][k], b[g][k]) for g in ("model", "optim") for k in a[g])


def _in_child(fn: Callable[[], str]) -> tuple[str, float, int]:
    """Run ``fn`` in a forked child; (its outcome, wall seconds, peak RSS bytes)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        resource.setrlimit(resource.RLIMIT_AS, (_CAP_BYTES, _CAP_BYTES))
        start = time.monotonic()
        try:
            outcome = fn()
        except BaseException as error:  # noqa: BLE001 - the outcome to report
            outcome = _describe(error)
        os.write(write, pickle.dumps((outcome, time.monotonic() - start)))
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + _KILL_S
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            done, status, usage = os.wait4(pid, 0)
            os.close(read)
            return f"killed after {_KILL_S:.0f} s", _KILL_S, usage.ru_maxrss * 1024
        time.sleep(0.002)
    data = b"".join(iter(lambda: os.read(read, 1 << 16), b""))
    os.close(read)
    if not data:
        return f"child died ({status:#x})", 0.0, usage.ru_maxrss * 1024
    outcome, seconds = pickle.loads(data)
    return outcome, seconds, usage.ru_maxrss * 1024


def _describe(error: BaseException) -> str:
    failures = getattr(error, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _dcp_load(impl: str, root: Path, state: dict[str, Any]) -> Callable[[], str]:
    def load() -> str:
        warnings.simplefilter("ignore")
        target = _target(state)
        if impl == "ours":
            dcp.load(target, checkpoint_id=root)
        else:
            import torch.distributed.checkpoint as torch_dcp
            torch_dcp.load(target, checkpoint_id=root, no_dist=True)
        return "loaded, equal" if _equal(target, state) else "loaded DIFFERENT values"
    return load


def _file_load(impl: str, path: Path) -> Callable[[], str]:
    def load() -> str:
        (tp.load if impl == "ours" else torch.load)(path)
        return "loaded"
    return load


# ---------------------------------------------------------------- the named hostile inputs

def _link(target: str, name: str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / name).unlink()
        (root / name).symlink_to(target)
    return make


def _declare_2gib(root: Path) -> None:
    meta = read_metadata(root)
    index = max(meta.storage_data, key=lambda i: meta.storage_data[i].offset)  # the last: overlapping none
    meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], length=2 << 30)
    write_metadata(root, meta)


def _declare_2gib_sparse(root: Path) -> None:
    meta = read_metadata(root)
    index = max(meta.storage_data, key=lambda i: meta.storage_data[i].offset)  # the last item of its file
    info = meta.storage_data[index]
    os.truncate(root / info.relative_path, info.offset + (2 << 30))  # a hole: 2 GiB of zeros, no blocks
    meta.storage_data[index] = dataclasses.replace(info, length=2 << 30)
    write_metadata(root, meta)


def _path_to(make_path: Callable[[Path, str], str]) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        outside = root.parent / "outside"
        outside.mkdir(exist_ok=True)
        meta = read_metadata(root)
        name = next(iter(meta.storage_data.values())).relative_path
        shutil.copy(root / name, outside / name)
        meta.storage_data = {i: dataclasses.replace(info, relative_path=make_path(outside, info.relative_path))
                             for i, info in meta.storage_data.items()}
        write_metadata(root, meta)
    return make


def _shard_linked_outside(root: Path) -> None:
    name = next(p.name for p in root.iterdir() if p.suffix == ".distcp")
    shutil.copy(root / name, root.parent / "outside.distcp")
    (root / name).unlink()
    (root / name).symlink_to(root.parent / "outside.distcp")


HOSTILE_DIRS: dict[str, Callable[[Path], None]] = {
    ".metadata -> /dev/zero": _link("/dev/zero", ".metadata"),
    "manifest -> /dev/zero": _link("/dev/zero", ".tensorplay_manifest.json"),
    "item declares 2 GiB beyond its file (manifest recomputed)": _declare_2gib,
    "item declares 2 GiB over a sparse hole (manifest recomputed)": _declare_2gib_sparse,
    "storage path ../outside/x.distcp": _path_to(lambda outside, name: f"../outside/{name}"),
    "absolute storage path": _path_to(lambda outside, name: str(outside / name)),
    "shard is a symlink to a file outside": _shard_linked_outside,
}


def _bomb(path: Path) -> None:
    add_bomb_record(path, 2 << 30)


def _overlapping(path: Path) -> None:
    path.write_bytes(overlapping_records(path.read_bytes(), 1000))


HOSTILE_FILES: dict[str, Callable[[Path], None]] = {
    ".pt with an extra record deflated from 2 GiB": _bomb,
    ".pt listing one record 1,000 more times (overlapping)": _overlapping,
}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def hostile_table(work: Path, pristine: Path, state: dict[str, Any], baseline: int) -> None:
    print("| hostile input | impl | peak RSS over idle (MiB) | time (s) | outcome |")
    print("|---|---|---|---|---|")
    for name, make in HOSTILE_DIRS.items():
        for impl in ("ours", "torch"):
            case = work / f"case-{impl}"
            shutil.rmtree(case, ignore_errors=True)
            shutil.copytree(pristine, case / "ckpt", symlinks=True)
            make(case / "ckpt")
            outcome, seconds, rss = _in_child(_dcp_load(impl, case / "ckpt", state))
            print(f"| {name} | {impl} | {_mib(max(0, rss - baseline))} | {seconds:.3f} | {outcome[:160]} |",
                  flush=True)
            shutil.rmtree(case, ignore_errors=True)
    pt = work / "state.pt"
    torch.save({"w": torch.randn(512 * 1024)}, pt)  # 2 MiB
    for name, make in HOSTILE_FILES.items():
        hostile = work / f"hostile{len(name)}.pt"
        shutil.copy(pt, hostile)
        make(hostile)
        for impl in ("ours", "torch"):
            outcome, seconds, rss = _in_child(_file_load(impl, hostile))
            print(f"| {name} | {impl} | {_mib(max(0, rss - baseline))} | {seconds:.3f} | {outcome[:160]} |",
                  flush=True)
        hostile.unlink()


def fuzz(work: Path, pristine: Path, state: dict[str, Any], baseline: int, count: int, seed: int,
         size: int, intact: int) -> None:
    rng = random.Random(seed)
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: {"n": 0, "rss": 0, "s": 0.0, "outcomes": defaultdict(int)})
    over: list[str] = []
    bound = intact + 2 * size
    for _ in range(count):
        case = work / "fuzz"
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(pristine, case / "ckpt", symlinks=True)
        kind, what = damage(case / "ckpt", rng)
        outcome, seconds, rss = _in_child(_dcp_load("ours", case / "ckpt", state))
        row = rows[kind]
        row["n"] += 1
        row["rss"], row["s"] = max(row["rss"], rss - baseline), max(row["s"], seconds)
        row["outcomes"][outcome.split(":")[0] if not outcome.startswith("loaded") else outcome] += 1
        if rss - baseline > bound or seconds > 1.0 or outcome.startswith(("loaded DIFFERENT", "killed", "child")):
            over.append(f"{kind}: {what}: {outcome} ({_mib(rss - baseline)} MiB, {seconds:.2f} s)")
    print(f"\n{count} random damages of a {size / 2**20:.2f} MiB checkpoint (seed {seed}); bound: peak RSS over "
          f"idle <= {_mib(bound)} MiB (an intact load's {_mib(intact)} + 2 x {_mib(size)}) and time <= 1 s\n")
    print("| class | runs | largest peak RSS over idle (MiB) | longest (s) | outcomes |")
    print("|---|---|---|---|---|")
    for kind in sorted(rows):
        row = rows[kind]
        outcomes = ", ".join(f"{name} {n}" for name, n in sorted(row["outcomes"].items(), key=lambda x: -x[1]))
        print(f"| {kind} | {row['n']} | {_mib(row['rss'])} | {row['s']:.3f} | {outcomes} |")
    print(f"\nout of bounds or wrong: {len(over)}")
    for line in over[:20]:
        print("  ", line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    torch.set_num_threads(1)  # the loads run in forked children: no intra-op thread pool to inherit broken
    assert set(KINDS)  # the classes drawn from
    state = _model_state()
    with tempfile.TemporaryDirectory(prefix="tp-fuzz-") as tmp:
        work = Path(tmp)
        dcp.save(state, checkpoint_id=work / "pristine")
        size = sum(p.stat().st_size for p in (work / "pristine").iterdir())
        _, _, idle = _in_child(lambda: "idle")
        loaded = max(_in_child(_dcp_load("ours", work / "pristine", state))[2] for _ in range(5))  # RSS noise
        print(f"checkpoint: {size / 2**20:.2f} MiB in {len(list((work / 'pristine').iterdir()))} files; an intact "
              f"load: {_mib(loaded - idle)} MiB over an idle child\n")
        hostile_table(work, work / "pristine", state, idle)
        fuzz(work, work / "pristine", state, idle, args.count, args.seed, size, loaded - idle)


if __name__ == "__main__":
    main()
