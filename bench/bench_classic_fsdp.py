"""Classic FullyShardedDataParallel: ours vs PyTorch's vs DDP, 2 Gloo ranks, a ~20M-parameter MLP, Adam.

Every Linear is its own unit (``ModuleWrapPolicy({nn.Linear})``). All settings
run on one pooled process pair, interleaved per repeat so that load from other
processes hits them alike; a training iteration is forward + backward +
``Adam.step()``. The table shows the fastest iteration (the one least disturbed
by other load) and the median, max over ranks, best of the repeats, and ratios
to PyTorch's FSDP with the same strategy and to DDP.

    .venv/bin/python bench/bench_classic_fsdp.py [--iters 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch import nn

from _timing import rank_step_timer  # bench/ is on sys.path when run as a script
from tensorplay.testing.distributed import run_distributed

WIDTH, DEPTH, BATCH, WARMUP = 1280, 12, 16, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def _wrap(impl: str, strategy: str) -> nn.Module:
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(_model())
    if impl == "ours":
        from tensorplay.distributed import fsdp
        from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed import fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return fsdp.FullyShardedDataParallel(_model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                         sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
                                         device_id=torch.device("cpu"))


def measure(impl: str, strategy: str, iters: int) -> dict[str, float]:
    model = _wrap(impl, strategy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    times_ms: list[float] = []
    for it in range(WARMUP + iters):
        with rank_step_timer(times_ms if it >= WARMUP else None):
            model(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    times = [t / 1e3 for t in times_ms]
    return {"min": min(times), "median": statistics.median(times),
            "params": sum(p.numel() for p in _model().parameters())}


SETTINGS = [("ddp", "")] + [(impl, strategy) for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
                            for impl in ("ours", "torch")]


def run_all(iters: int, repeats: int) -> dict[tuple[str, str], dict[str, float]]:
    results: dict[tuple[str, str], list[dict[str, float]]] = {setting: [] for setting in SETTINGS}
    for _ in range(repeats):
        for setting in SETTINGS:
            ranks = run_distributed(measure, *setting, iters, world_size=2, timeout=600)
            results[setting].append({key: max(r[key] for r in ranks) for key in ranks[0]})
    return {setting: {key: min(r[key] for r in runs) for key in runs[0]} for setting, runs in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = run_all(args.iters, args.repeats)
    ddp = results[("ddp", "")]
    print(f"{ddp['params'] / 1e6:.1f}M parameters, 2 Gloo ranks, batch {BATCH} per rank, Adam; "
          f"iteration times in ms (fastest / median)\n")
    print("| strategy | ours | PyTorch FSDP | DDP | ours / PyTorch | ours / DDP |")
    print("|---|---|---|---|---|---|")
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        ours, theirs = results[("ours", strategy)], results[("torch", strategy)]
        print(f"| {strategy} | {1e3 * ours['min']:.0f} / {1e3 * ours['median']:.0f} "
              f"| {1e3 * theirs['min']:.0f} / {1e3 * theirs['median']:.0f} "
              f"| {1e3 * ddp['min']:.0f} / {1e3 * ddp['median']:.0f} "
              f"| {ours['min'] / theirs['min']:.2f} | {ours['min'] / ddp['min']:.2f} |")


if __name__ == "__main__":
    main()
