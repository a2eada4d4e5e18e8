"""ShardedGradScaler: unscale_ + step + update time, ours vs PyTorch's (device="cpu"), 2 Gloo ranks.

Each rank holds gradient shards (plain tensors, as flat-parameter shards, or
DTensor shards) of the given shapes; one timed iteration restores the scaled
gradients, then runs ``unscale_`` (local check + all-reduce of the flag), ``step``
(SGD) and ``update``. Ours and PyTorch's alternate iteration by iteration; the
table shows the slower rank's median, in milliseconds.

    .venv/bin/python bench/bench_sharded_grad_scaler.py
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tensorplay.distributed.tensor import Shard, distribute_tensor
from tensorplay.testing.distributed import run_distributed

WORLD, WARMUP, ITERS = 2, 4, 40
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


class _Setup:
    """One scaler over its own parameters, with the scaled gradients to restore before each iteration."""

    def __init__(self, scaler: Any, count: int, numel: int, dtype: torch.dtype, as_dtensor: bool) -> None:
        self.params = _params(count, numel, dtype, as_dtensor)
        self.optimizer = tp.optim.SGD(self.params, lr=1e-3)
        self.scaler = scaler
        self.scaler.scale(tp.ones(()))  # creates the scale
        self.scaled_grads = [(p.detach() * 1024).to(dtype) for p in self.params]
        self.times: list[float] = []

    def iteration(self, record: bool) -> None:
        for p, g in zip(self.params, self.scaled_grads, strict=True):
            p.grad = g.clone()
        dist.barrier()
        start = time.perf_counter()
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if record:
            self.times.append(time.perf_counter() - start)


def bench_rank() -> dict[str, tuple[float, float]]:
    """Ours and PyTorch's alternate iteration by iteration, so background load hits both alike."""
    results = {}
    for name, count, numel, dtype, as_dtensor in CASES:
        setups = [_Setup(ShardedGradScaler(device="cpu"), count, numel, dtype, as_dtensor),
                  _Setup(TorchShardedGradScaler(device="cpu"), count, numel, dtype, as_dtensor)]
        for i in range(WARMUP + ITERS):
            for setup in setups if i % 2 else reversed(setups):
                setup.iteration(record=i >= WARMUP)
        ours, theirs = (statistics.median(setup.times) * 1e3 for setup in setups)
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
