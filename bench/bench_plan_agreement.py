"""Plan agreement: what the one small all-gather at init costs, 2 Gloo ranks.

``check_plan_agreement`` (hash the plan, all-gather two int64 per rank, compare)
runs once per model: at fully_shard's and classic FSDP's first forward, and at
ZeroRedundancyOptimizer's construction. The table shows its median time for
plans of 50 and 400 parameters, next to the whole first forward of a
fully_shard model (ours, which includes the check, and PyTorch's, which has
none) and a ZeRO construction, so the check's share of init is visible.

    .venv/bin/python bench/bench_plan_agreement.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

WORLD, WARMUP, ITERS = 2, 2, 21


def _median_ms(fn: Callable[[], Any], iters: int = ITERS) -> float:
    samples = []
    for i in range(WARMUP + iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if i >= WARMUP:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])


def _first_forward(impl: str, layers: int) -> None:
    if impl == "ours":
        from tensorplay.distributed.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    model = _model(layers)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.ones(2, 64)).sum().backward()


def _zero(layers: int) -> None:
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer
    ZeroRedundancyOptimizer(_model(layers).parameters(), torch.optim.SGD, lr=0.1)


def measure() -> list[dict[str, float]]:
    from tensorplay.distributed._checks.plan_agreement import PlanEntry, check_plan_agreement
    rows = []
    for layers in (25, 200):  # 50 and 400 parameters
        plan = [PlanEntry(f"{i}.{kind}", (64, 64) if kind == "weight" else (64,), "torch.float32", "unit")
                for i in range(layers) for kind in ("weight", "bias")]
        rows.append({
            "params": 2 * layers,
            "check": _median_ms(lambda plan=plan: check_plan_agreement(plan, None, what="bench")),
            "ours": _median_ms(lambda n=layers: _first_forward("ours", n), iters=3),
            "torch": _median_ms(lambda n=layers: _first_forward("torch", n), iters=3),
            "zero": _median_ms(lambda n=layers: _zero(n), iters=3),
        })
    return rows


def main() -> None:
    per_rank = run_distributed(measure, world_size=WORLD, timeout=900)
    print(f"### Plan agreement at init, {WORLD} Gloo ranks (median ms, slower rank)\n")
    print("| parameters | check | fully_shard + first step, ours | PyTorch's (no check) | check / ours "
          "| ZeRO construction | check / ZeRO |")
    print("|---|---|---|---|---|---|---|")
    for index, row in enumerate(per_rank[0]):
        worst = {key: max(rank[index][key] for rank in per_rank) for key in row}
        print(f"| {worst['params']:.0f} | {worst['check']:.2f} | {worst['ours']:.1f} | {worst['torch']:.1f} "
              f"| {worst['check'] / worst['ours']:.1%} | {worst['zero']:.1f} | {worst['check'] / worst['zero']:.1%} |")


if __name__ == "__main__":
    main()
