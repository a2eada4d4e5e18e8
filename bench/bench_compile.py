"""torch.compile of a whole fully_shard model: ours vs PyTorch's fully_shard, compiled vs eager, Gloo (CPU), 2 ranks.

A small transformer (``--blocks`` blocks of width ``--dim``), one fully_shard per block plus the root, SGD.
Each implementation's model is built twice in the same processes (eager, compiled) and the four steppers
alternate step by step, so load from other processes hits all alike. Prints the median step time, the
compiled / eager ratio per implementation and ours / PyTorch's per mode, and the graphs dynamo compiled
(graph breaks + 1). The first compiled steps (compilation) are warm-up and not counted.

    .venv/bin/python bench/bench_compile.py [--dim 256] [--blocks 4] [--steps 10] [--backend inductor]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from _timing import interleaved_median_ms  # bench/ is on sys.path
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

IMPLS = ("ours", "torch")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def _sharded(impl: str, dim: int, blocks: int) -> nn.Module:
    if impl == "ours":
        import tensorplay.distributed.fsdp as api
    else:
        import torch.distributed.fsdp as api
    tp.manual_seed(0)
    model = nn.Sequential(*(Block(dim) for _ in range(blocks)), nn.Linear(dim, dim))
    for block in list(model)[:-1]:
        api.fully_shard(block)
    return api.fully_shard(model)


def _stepper(model: nn.Module, forward: Any, x: torch.Tensor) -> Any:
    optimizer = tp.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        forward(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def measure(dim: int, blocks: int, steps: int, backend: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    x = tp.randn(8, 32, dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    steppers, graphs = {}, {}
    for impl in IMPLS:
        eager = _sharded(impl, dim, blocks)
        steppers[(impl, "eager")] = _stepper(eager, eager, x)
        compiled = _sharded(impl, dim, blocks)
        before = counters["stats"]["unique_graphs"]
        steppers[(impl, "compiled")] = step = _stepper(compiled, torch.compile(compiled, backend=backend), x)
        step()  # compile now, so the timed loop's warm-up is only warm-up
        graphs[impl] = counters["stats"]["unique_graphs"] - before
    times = interleaved_median_ms(steppers, warmup=2, iters=steps)
    return {"times": times, "graphs": graphs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    result = run_distributed(measure, args.dim, args.blocks, args.steps, args.backend, world_size=2,
                             timeout=1200)[0]
    times, graphs = result["times"], result["graphs"]
    print(f"\n### torch.compile of a whole fully_shard model (2 ranks, {args.blocks} blocks x {args.dim}, "
          f"backend {args.backend}; median ms per step, rank 0)\n")
    print("| implementation | eager | compiled | compiled / eager | graphs compiled |")
    print("|---|---|---|---|---|")
    for impl in IMPLS:
        eager, compiled = times[(impl, "eager")], times[(impl, "compiled")]
        print(f"| {impl} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f} | {graphs[impl]} |")
    for mode in ("eager", "compiled"):
        print(f"\nours / PyTorch's, {mode}: {times[('ours', mode)] / times[('torch', mode)]:.2f}")


if __name__ == "__main__":
    main()
