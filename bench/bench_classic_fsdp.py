"""Classic FullyShardedDataParallel: ours vs PyTorch's FSDP (NO_SHARD also vs DDP), Gloo, Adam, 1 thread per rank.

Two MLPs, every Linear its own unit (``ModuleWrapPolicy({nn.Linear})``): issue
16's 8 x Linear(1024)+GELU at batch 32 per rank, and a ~20M-parameter
12 x Linear(1280)+ReLU at batch 16; on request (``--models small``) a third with
small units, 32 x Linear(256)+ReLU at batch 32. Layouts: 2 ranks, 4 ranks (oversubscribed
on the 2-core machine: ratios still hold side by side) and HYBRID_SHARD on 2x2
(shard over {0,1} and {2,3}, replicate across). A step is forward + backward +
``Adam.step()`` + ``zero_grad()``, timed from a barrier.

Time: per strategy, ours and PyTorch's (and DDP) live in the same processes
and take turns one step each; the ratio is the median of the per-turn ratios
(worst rank per step), so load from other processes hits both alike. Peak RSS:
each implementation alone in fresh processes for a few steps (max over ranks;
the model is built whole on every rank first, as in the timing runs;
``--fixed-heap``: with glibc's mmap threshold fixed, see [Note: peak RSS with a
fixed mmap threshold] in ``_timing.py``).

    .venv/bin/python bench/bench_classic_fsdp.py [--rounds 8] [--models issue,mlp20m] [--layouts 2,4,hsdp]
        (layout 1: one rank, not in the default set)
        [--strategies NO_SHARD,...] [--no-rss]

One row, cheaply: ``--models issue --layouts 2 --strategies NO_SHARD --rounds 6 --no-rss``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from _timing import add_heap_option, fixed_heap, peak_memory_mib  # bench/ is on sys.path when run as a script
from tensorplay.testing.distributed import run_distributed

# width, depth, batch, activation; "small" (not run by default): 32 units of 257 KiB, whose NO_SHARD gradients
# share all-reduce buckets (see grad_buckets.py; the other models' units are reduced one by one)
MODELS = {"issue": (1024, 8, 32, "GELU"), "mlp20m": (1280, 12, 16, "ReLU"), "small": (256, 32, 32, "ReLU")}
LAYOUTS = {"1": 1, "2": 2, "4": 4, "hsdp": 4}                                # name -> world size
STRATEGIES = {"1": ("FULL_SHARD", "NO_SHARD"), "2": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
              "4": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
              "hsdp": ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")}
WARMUP, RSS_STEPS = 2, 3


def _model(name: str) -> nn.Module:
    width, depth, _, activation = MODELS[name]
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), getattr(nn, activation)()]
    return nn.Sequential(*layers)


def _hybrid_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    rank = dist.get_rank()
    shard = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]
    replicate = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])][rank % 2]
    return shard, replicate


def _wrap(impl: str, strategy: str, model_name: str) -> nn.Module:
    if impl == "ddp":
        return nn.parallel.DistributedDataParallel(_model(model_name))
    if impl == "ours":
        from tensorplay.distributed import fsdp
        from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed import fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    group = _hybrid_groups() if strategy.lstrip("_").startswith("HYBRID") else None
    return fsdp.FullyShardedDataParallel(_model(model_name), process_group=group,
                                         auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                         sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
                                         device_id=torch.device("cpu"))


def _stepper(impl: str, strategy: str, model_name: str):  # noqa: ANN202 (a closure)
    model = _wrap(impl, strategy, model_name)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    width, _, batch, _ = MODELS[model_name]
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()

    return step


def _impls(strategy: str) -> list[str]:
    return ["ours", "torch", "ddp"] if strategy == "NO_SHARD" else ["ours", "torch"]


def time_turns(strategy: str, model_name: str, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """On every rank: one step of each implementation in turn; per implementation, (wall, CPU) ms per step.

    CPU is the process's CPU time (every thread: compute and the Gloo threads' communication), which
    load from other processes changes far less than the wall time.
    """
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD's deprecation notice
    steps = {impl: _stepper(impl, strategy, model_name) for impl in _impls(strategy)}
    times: dict[str, list[tuple[float, float]]] = {impl: [] for impl in steps}
    for turn in range(WARMUP + rounds):
        for impl, step in steps.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            step()
            if turn >= WARMUP:
                times[impl].append(((time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3))
    return times


def peak_rss(impl: str, strategy: str, model_name: str) -> dict[str, float]:
    """Peak RSS and host share of this process (MiB, see ``peak_memory_mib``) after a few steps of one
    implementation alone."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    step = _stepper(impl, strategy, model_name)
    for _ in range(RSS_STEPS):
        step()
    return peak_memory_mib()


def measure(layout: str, model_name: str, strategy: str, rounds: int, rss: bool,
            fixed: bool = False) -> dict[str, dict[str, float]]:
    world = LAYOUTS[layout]
    per_rank = run_distributed(time_turns, strategy, model_name, rounds, world_size=world, timeout=900)
    worst = {impl: [max(rank[impl][i][0] for rank in per_rank) for i in range(rounds)] for impl in per_rank[0]}
    rows: dict[str, dict[str, float]] = {}
    for impl, times in worst.items():
        cpu = [statistics.mean(rank[impl][i][1] for rank in per_rank) for i in range(rounds)]
        rows[impl] = {"ms": statistics.median(times), "cpu": statistics.median(cpu),
                      "ratio": statistics.median(t / u for t, u in zip(times, worst["torch"], strict=True)),
                      "spread": max(times) / min(times)}
        if impl == "ours" and "ddp" in worst:
            rows[impl]["vs_ddp"] = statistics.median(t / u for t, u in zip(times, worst["ddp"], strict=True))
        if rss:
            with fixed_heap(fixed):
                ranks = run_distributed(peak_rss, impl, strategy, model_name, world_size=world, fresh=True,
                                        timeout=900)
                rows[impl]["rss"] = max(r["peak"] for r in ranks)
                rows[impl]["share"] = max(r["share"] for r in ranks)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--models", default="issue,mlp20m")
    parser.add_argument("--layouts", default="2,4,hsdp")
    parser.add_argument("--strategies", default="", help="comma-separated subset (default: all of the layout)")
    parser.add_argument("--no-rss", action="store_true")
    add_heap_option(parser)
    args = parser.parse_args()
    only = set(filter(None, args.strategies.split(",")))
    print("Classic FSDP, Gloo on CPU, 1 thread per rank, Adam; step = forward + backward + step + zero_grad. "
          f"ms: median of {args.rounds} turns (worst rank); ratio: median of per-turn ours/PyTorch "
          "(NO_SHARD: also ours/DDP); spread: slowest/fastest turn; CPU: median process CPU ms per step and rank "
          "(all threads; NO_SHARD: also DDP's); RSS: peak MiB per rank, alone, fresh processes; share: ours at that "
          "peak with the shared-memory slots counted once per host (PyTorch's and DDP's equal their RSS)\n")
    print("| model | layout | strategy | ours ms | PyTorch ms | ours / PyTorch | ours / DDP | spread ours, PyTorch "
          "| CPU ours / PyTorch (/ DDP) | RSS ours | RSS PyTorch | RSS DDP | share ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for layout in args.layouts.split(","):
            for strategy in STRATEGIES[layout]:
                if only and strategy not in only:
                    continue
                rows = measure(layout, model_name, strategy, args.rounds, not args.no_rss, args.fixed_heap)
                ours, theirs, ddp = rows["ours"], rows["torch"], rows.get("ddp")
                place = {"1": "1 rank", "2": "2 ranks", "4": "4 ranks (oversubscribed)", "hsdp": "2x2 HSDP"}[layout]
                vs_ddp = f"{ours['vs_ddp']:.2f}" if ddp else ""
                cpu = " / ".join(f"{r['cpu']:.0f}" for r in (ours, theirs, ddp) if r)
                rss = [f"{r['rss']:.0f}" if r and "rss" in r else "" for r in (ours, theirs, ddp)]
                rss.append(f"{ours['share']:.1f}" if "share" in ours else "")
                print(f"| {model_name} | {place} | {strategy} | {ours['ms']:.0f} | {theirs['ms']:.0f} "
                      f"| {ours['ratio']:.2f} | {vs_ddp} | {ours['spread']:.1f}, {theirs['spread']:.1f} "
                      f"| {cpu} "
                      f"| {' | '.join(rss)} |", flush=True)


if __name__ == "__main__":
    main()
