"""The flat collectives per algorithm: PyTorch's Gloo calls against our compositions and shared memory.

Each rank times one all-gather, reduce-scatter, all-reduce and broadcast (from
rank 0) of a 4 MiB and a 32 MiB fp32 buffer (all-gather: the gathered size) through
``tensorplay.distributed._comm.collectives`` with every algorithm of the plan
table, interleaved round-robin, a barrier before each call; the median of the
slowest rank's times is printed in ms with its ratio to PyTorch's own call
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``broadcast``). 4 ranks
run oversubscribed on 2 cores. These are the figures behind ``collectives.PLANS``.

    .venv/bin/python bench/bench_collectives.py [--world 2 4] [--iters 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives
from tensorplay.testing.distributed import run_distributed

SIZES_MIB = (4, 32)
WARMUP = 3
#: (operation, algorithm): "native" is PyTorch's own Gloo call; the rest go through our collectives.
CASES = [("all-gather", "native"), ("all-gather", "broadcast"), ("all-gather", "shared_memory"),
         ("reduce-scatter", "native"), ("reduce-scatter", "all_reduce"), ("reduce-scatter", "exchange"),
         ("reduce-scatter", "shared_memory"), ("all-reduce", "native"), ("all-reduce", "shared_memory"),
         ("broadcast", "native"), ("broadcast", "shared_memory")]


def _call(op: str, algo: str, numel: int) -> Callable[[], object]:
    world = dist.get_world_size()
    full, shard = torch.randn(numel), torch.randn(numel // world)
    if algo == "native":
        return {"all-gather": lambda: torch.distributed.all_gather_into_tensor(full, shard),
                "reduce-scatter": lambda: torch.distributed.reduce_scatter_tensor(shard, full),
                "all-reduce": lambda: torch.distributed.all_reduce(full),
                "broadcast": lambda: torch.distributed.broadcast(full, 0)}[op]
    ours: dict[str, Callable[[], object]] = {
        "all-gather": lambda: collectives.all_gather_flat(full, shard),
        "reduce-scatter": lambda: collectives.reduce_scatter_flat(shard, full),
        "all-reduce": lambda: collectives.all_reduce(full),
        "broadcast": lambda: collectives.broadcast(full, 0)}
    plan = {op.replace("-", "_"): algo}

    def run() -> None:
        collectives.set_collective_plan("gloo", **plan)  # type: ignore[arg-type]
        ours[op]()
    return run


def _rank(iters: int) -> dict[str, float]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # PyTorch's note on its *_tensor names
    world = dist.get_world_size()
    saved = collectives.PLANS["gloo"]
    calls = {f"{op} {algo} {mib}": _call(op, algo, mib * 2**18)
             for mib in SIZES_MIB for op, algo in CASES if not (algo == "exchange" and world != 2)}
    samples: dict[str, list[float]] = {key: [] for key in calls}
    try:
        for i in range(WARMUP + iters):
            for key, call in calls.items():
                dist.barrier()
                start = time.perf_counter()
                call()
                if i >= WARMUP:
                    samples[key].append((time.perf_counter() - start) * 1e3)
    finally:
        collectives.PLANS["gloo"] = saved
    return {key: statistics.median(values) for key, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    print(__doc__.splitlines()[0])
    print("\n| ranks | size | operation | algorithm | ms (slowest rank, median) | / PyTorch's |")
    print("|---|---|---|---|---|---|")
    for world in args.world:
        per_rank = run_distributed(_rank, args.iters, world_size=world, timeout=600)
        for key in per_rank[0]:
            op, algo, mib = key.split()
            ms = max(times[key] for times in per_rank)
            native = max(times[f"{op} native {mib}"] for times in per_rank)
            label = f"{world} (oversubscribed)" if world > 2 else str(world)
            print(f"| {label} | {mib} MiB | {op} | {algo} | {ms:.1f} | {ms / native:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
