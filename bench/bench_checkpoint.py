"""Distributed checkpoint save / load: ours (atomic, checksummed, verified, staged) vs PyTorch's DCP.

2 Gloo ranks, a state of ``--params`` parameters (default 104M, fp32) as DTensors
sharded over the ranks, written to a temporary directory with fsync (both
implementations' default). Saves and loads of ours and PyTorch's alternate, so a
shared machine's load hits both alike; each row is the median over ``--iters``.
A second table saves a ZeRO optimizer's state at 4 ranks: ours (every rank
writes the state of the parameters it owns) against ``consolidate_state_dict``
(the whole state gathered on rank 0, then saved there).
Peak memory is the rise of the process's peak RSS during the call (VmHWM reset
before each call), per rank. Deleting the replaced checkpoint is left out of both
save times (PyTorch's is removed before its save, ours on a background thread that
is joined before the load). The last column is what the safety checks cost:
ours / PyTorch's - 1 (the target is under 15%).

    .venv/bin/python bench/bench_checkpoint.py [--params 104] [--iters 3] [--no-fsync] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tensorplay.testing.distributed import run_distributed

TENSORS = 8
ZERO_WIDTH, ZERO_LAYERS, ZERO_WORLD = 1024, 8, 4


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measured(fn: Callable[[], None]) -> tuple[float, float]:
    """Seconds and peak-RSS rise (MiB) of one call."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    base = _rss_mib("VmRSS")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, _rss_mib("VmHWM") - base


def _join_cleanup() -> None:
    """Wait for our writer's background deletion of a replaced checkpoint (so it does not slow the next load)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "tensorplay-checkpoint-cleanup":
            thread.join()


def _state(params_m: int) -> dict[str, Any]:
    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    rows = params_m * 1_000_000 // TENSORS // 1024 // world * world
    gen = torch.Generator().manual_seed(rank)
    return {f"layer{i}.weight": DTensor.from_local(torch.randn(rows // world, 1024, generator=gen), mesh, [Shard(0)])
            for i in range(TENSORS)}


def bench_rank(params_m: int, iters: int, root: str, sync: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as torch_dcp

    import tensorplay.distributed as dist
    import tensorplay.distributed.checkpoint as our_dcp

    warnings.simplefilter("ignore")
    impls = {"ours": our_dcp, "torch": torch_dcp}
    writers = {name: lambda path, dcp=dcp: dcp.FileSystemWriter(path, sync_files=sync) for name, dcp in impls.items()}
    state = _state(params_m)
    numel = sum(t.numel() for t in state.values())
    samples: dict[str, list[tuple[float, float]]] = {f"{i}_{op}": [] for i in impls for op in ("save", "load")}
    for _ in range(iters):
        for name, dcp in impls.items():
            path = f"{root}/{name}"
            if name == "torch":  # PyTorch's writer overwrites in place; start it from nothing like ours
                dist.barrier()
                if dist.get_rank() == 0:
                    shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            samples[f"{name}_save"].append(_measured(
                lambda name=name, dcp=dcp, path=path: dcp.save(state, storage_writer=writers[name](path))))
            _join_cleanup()  # ours deletes the replaced checkpoint on a thread; PyTorch's rmtree is untimed too
            dist.barrier()
            samples[f"{name}_load"].append(_measured(lambda dcp=dcp, path=path: dcp.load(state, checkpoint_id=path)))
    out = {key: {"s": statistics.median(t for t, _ in v), "peak_mib": max(m for _, m in v)}
           for key, v in samples.items()}
    out["numel"] = numel  # DTensor numel is the global one
    return out


def zero_rank(root: str) -> dict[str, float]:
    """Peak-RSS rise while saving ZeRO's optimizer state: ours (each rank its own FQNs) vs consolidating on rank 0."""
    import tensorplay as tp
    import tensorplay.distributed as dist
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(ZERO_WIDTH, ZERO_WIDTH) for _ in range(ZERO_LAYERS)])
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    model(torch.randn(4, ZERO_WIDTH)).sum().backward()
    zero.step()

    def ours() -> None:
        dcp.save({"optim": get_optimizer_state_dict(model, zero)}, checkpoint_id=f"{root}/zero_ours")

    def consolidated() -> None:
        zero.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            tp.save(zero.state_dict(), f"{root}/zero_consolidated.pt")
        dist.barrier()

    state_mib = sum(t.numel() * t.element_size() for s in zero.optim.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor)) / 2**20
    out = {"own_state_mib": state_mib}
    for name, fn in (("ours", ours), ("consolidate", consolidated)):
        dist.barrier()
        out[f"{name}_s"], out[f"{name}_peak_mib"] = _measured(fn)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=104, help="millions of parameters in all")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-fsync", action="store_true",
                        help="sync_files=False for both: isolates the checks' CPU cost from the disk's flush time")
    parser.add_argument("--dir", default=None, help="where to write (e.g. /dev/shm: no disk at all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        ranks = run_distributed(bench_rank, args.params, args.iters, root, not args.no_fsync, world_size=2,
                                timeout=900)
    print(f"\n{ranks[0]['numel'] / 1e6:.0f}M fp32 parameters, 2 ranks, {args.iters} iterations (median), "
          f"fsync {'off' if args.no_fsync else 'on'}\n")
    print("| op | rank | PyTorch s | ours s | peak MiB PyTorch | peak MiB ours | checks cost |")
    print("|---|---|---|---|---|---|---|")
    for op in ("save", "load"):
        for rank, r in enumerate(ranks):
            t, o = r[f"torch_{op}"], r[f"ours_{op}"]
            print(f"| {op} | {rank} | {t['s']:.2f} | {o['s']:.2f} | {t['peak_mib']:.0f} | {o['peak_mib']:.0f} | "
                  f"{o['s'] / t['s'] - 1:+.0%} |")
    with tempfile.TemporaryDirectory() as root:
        zero = run_distributed(zero_rank, root, world_size=ZERO_WORLD, timeout=900)
    total = sum(r["own_state_mib"] for r in zero)
    print(f"\nZeRO (Adam, {ZERO_LAYERS}x{ZERO_WIDTH}^2 weights, {ZERO_WORLD} ranks, {total:.0f} MiB of optimizer state "
          f"in all): peak-RSS rise while saving\n")
    print("| rank | own state MiB | ours: each rank its own FQNs, MiB | consolidate_state_dict + save on rank 0, MiB |")
    print("|---|---|---|---|")
    for rank, r in enumerate(zero):
        print(f"| {rank} | {r['own_state_mib']:.0f} | {r['ours_peak_mib']:.0f} | {r['consolidate_peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
