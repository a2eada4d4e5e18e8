"""ShardedGradScaler: unscale_ + step + update time, ours vs PyTorch's (device="cpu"), 2 Gloo ranks.

Each rank holds gradient shards (plain tensors, as flat-parameter shards, or
DTensor shards) of the given shapes; one timed iteration restores the scaled
gradients, then runs ``unscale_`` (local check + all-reduce of the flag), ``step``
(SGD) and ``update``. Prints the median over ranks' medians, in milliseconds.

    .venv/bin/python bench/bench_sharded_grad_scaler.py
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tensorplay.distributed.tensor import Shard, distribute_tensor
from tensorplay.testing.distributed import run_distributed

WORLD, WARMUP, ITERS = 2, 3, 15
CASES: list[tuple[str, int, int, torch.dtype, bool]] = [
    # name, tensors, elements per tensor (unsharded), grad dtype, DTensor
    ("200 x 4k fp32", 200, 4096, torch.float32, False),
    ("8 x 1M fp32", 8, 1 << 20, torch.float32, False),
    ("8 x 1M fp16", 8, 1 << 20, torch.float16, False),
    ("50 x 64k fp32 DTensor", 50, 1 << 16, torch.float32, True),
]


def _params(count: int, numel: int, dtype: torch.dtype, as_dtensor: bool) -> list[torch.Tensor]:
    tp.manual_seed(0)
    if as_dtensor:
        mesh = init_device_mesh("cpu", (WORLD,))
        return [tp.nn.Parameter(distribute_tensor(tp.randn(numel).to(dtype), mesh, [Shard(0)]))
                for _ in range(count)]
    return [tp.nn.Parameter(tp.randn(numel // WORLD).to(dtype)) for _ in range(count)]


def _time_one(make_scaler: Callable[[], Any], count: int, numel: int, dtype: torch.dtype,
              as_dtensor: bool) -> float:
    params = _params(count, numel, dtype, as_dtensor)
    optimizer = tp.optim.SGD(params, lr=1e-3)
    scaler = make_scaler()
    scaler.scale(tp.ones(()))  # creates the scale
    scaled_grads = [(p.detach() * 1024).to(dtype) for p in params]
    times = []
    for i in range(WARMUP + ITERS):
        with torch.no_grad():
            for p, g in zip(params, scaled_grads):
                p.grad = g.clone()
        dist.barrier()
        start = time.perf_counter()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_rank() -> dict[str, tuple[float, float]]:
    results = {}
    for name, count, numel, dtype, as_dtensor in CASES:
        ours = _time_one(lambda: ShardedGradScaler(device="cpu"), count, numel, dtype, as_dtensor)
        theirs = _time_one(lambda: TorchShardedGradScaler(device="cpu"), count, numel, dtype, as_dtensor)
        results[name] = (ours, theirs)
    return results


def main() -> None:
    per_rank = run_distributed(bench_rank, world_size=WORLD, timeout=300)
    print(f"\nShardedGradScaler unscale_+step+update, {WORLD} Gloo ranks, median ms (max over ranks)\n")
    print("| gradients per rank | ours ms | PyTorch ms | PyTorch / ours |")
    print("|---|---|---|---|")
    for name, *_ in CASES:
        ours = max(rank[name][0] for rank in per_rank)
        theirs = max(rank[name][1] for rank in per_rank)
        print(f"| {name} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |")


if __name__ == "__main__":
    main()
