"""ZeroRedundancyOptimizer vs PyTorch's, 2 and 4 Gloo ranks, a ~20M-parameter MLP, Adam.

For each setting (ZeRO with bucket view off / on; ZeRO overlapped with DDP;
with ``--all`` also DDP + Adam and our interleaved hook) it times ours and
PyTorch's side by side in one process group (iterations alternated, so a shared
machine's load hits both alike), then measures each alone in a fresh group for
peak RSS and optimizer-state bytes, and prints a markdown table with ours /
PyTorch's ratios (of the medians). 4 ranks on a 2-core machine are
oversubscribed: absolute times mean little there, the side-by-side ratios
still hold. Overlap runs use ``shard_buckets=True`` (balanced state; the same
for both). PyTorch's ``hook_with_zero_step`` refuses Gloo; it is run with that
check bypassed (it works; its interleaved variant hangs on Gloo, so that one is
ours only).

Peak RSS moves by up to ~50 MiB between fresh runs of the same code on one rank (glibc's heap
reuse, see [Note: peak RSS with a fixed mmap threshold] in ``_timing.py``), so ``--mem-runs N``
repeats the memory measurement in N fresh process groups and reports the median of their worst-rank
peaks; ``--fixed-heap`` measures the memory each holds live instead. The host share counts the
shared-memory slots once per host (see ``peak_memory_mib`` in ``_timing.py``).

    .venv/bin/python bench/bench_zero.py [--iters 12] [--world 2 4] [--all] [--mem-runs 1]
    .venv/bin/python bench/bench_zero.py --world 4 --settings plain --iters 8 --mem-runs 3   # one row
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from _timing import add_heap_option, fixed_heap, peak_memory_mib, rank_step_timer  # bench/ is on sys.path
from tensorplay.testing.distributed import run_distributed

WIDTH, DEPTH, BATCH, WARMUP = 1280, 12, 16, 3
#: Below one weight (6.25 MiB), so DDP's buckets are about one layer each and a
#: partition that follows them (overlap) can balance the state.
BUCKET_CAP_MB = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _optimizer(impl: str, setting: str, ddp: Any) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    if setting == "ddp":
        return torch.optim.Adam(ddp.parameters(), lr=1e-4)
    cls = ZeroRedundancyOptimizer if impl == "ours" else TorchZeRO
    overlap = setting.startswith("overlap")
    zero = cls(ddp.parameters(), torch.optim.Adam, parameters_as_bucket_view=setting == "bucket",
               overlap_with_ddp=overlap, lr=1e-4)
    if overlap:
        ddp.register_comm_hook(None, _hook(impl, setting, ddp, zero))
    return zero


def _hook(impl: str, setting: str, ddp: Any, zero: Any) -> Any:
    kind = "hook_with_zero_step_interleaved" if setting == "overlap_interleaved" else "hook_with_zero_step"
    if impl == "ours":
        from tensorplay.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
        from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )

        return getattr(ddp_zero_hook, kind)(allreduce_hook, ddp, zero, shard_buckets=True)
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as theirs
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        allreduce_hook as their_allreduce,
    )

    with mock.patch.object(theirs.dist, "get_backend", return_value="nccl"):  # its Gloo refusal
        return getattr(theirs, kind)(their_allreduce, ddp, zero, shard_buckets=True)


def _state_bytes(optimizer: Any) -> int:
    local = getattr(optimizer, "optim", optimizer)
    return sum(v.numel() * v.element_size() for s in local.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


class Trainer:
    """One DDP model + optimizer of one implementation; ``iteration()`` times one training step."""

    def __init__(self, impl: str, setting: str) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.setting = setting
        self.ddp = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
        self.optimizer = _optimizer(impl, setting, self.ddp)
        self.x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
        self.steps: list[float] = []
        self.iterations: list[float] = []

    def iteration(self, record: bool) -> None:
        with rank_step_timer(self.iterations if record else None):
            self.ddp(self.x).pow(2).mean().backward()
            before_step = time.perf_counter()
            if not self.setting.startswith("overlap"):
                self.optimizer.step()
        if record:
            self.steps.append((time.perf_counter() - before_step) * 1e3)
        self.optimizer.zero_grad()


def time_side_by_side(setting: str, impls: list[str], iters: int) -> dict[str, dict[str, float]]:
    """Both implementations in one process pair, iterations alternated, so load changes hit both alike."""
    trainers = {impl: Trainer(impl, setting) for impl in impls}
    order = list(trainers.values())
    for it in range(WARMUP + iters):
        for trainer in order if it % 2 else order[::-1]:  # who goes first alternates too
            trainer.iteration(record=it >= WARMUP)
    times = {impl: {"step": statistics.median(t.steps) / 1e3, "step_min": min(t.steps) / 1e3,
                    "iter": statistics.median(t.iterations) / 1e3, "iter_min": min(t.iterations) / 1e3}
             for impl, t in trainers.items()}
    if "torch" in trainers:  # ratios of neighbouring iterations: robust to the load drifting during the run
        ours, theirs = trainers["ours"], trainers["torch"]
        for key, samples in (("step", "steps"), ("iter", "iterations")):
            times["ours"][f"pair_{key}"] = statistics.median(
                a / b for a, b in zip(getattr(ours, samples), getattr(theirs, samples), strict=True))
    return times


def memory_alone(impl: str, setting: str) -> dict[str, float]:
    """A fresh process pair per implementation: peak RSS and optimizer-state bytes."""
    trainer = Trainer(impl, setting)
    for _ in range(WARMUP + 1):
        trainer.iteration(record=False)
    params = sum(p.numel() for p in trainer.ddp.parameters())
    memory = peak_memory_mib()
    return {"rss": memory["peak"], "share": memory["share"],
            "state": _state_bytes(trainer.optimizer), "full_state": 2 * 4 * params}


def worst_rank(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: max(r[key] for r in ranks) if not isinstance(ranks[0][key], dict)
            else worst_rank([r[key] for r in ranks]) for key in ranks[0]}


SETTINGS = [("ddp", "DDP + Adam"), ("plain", "ZeRO, bucket view off"), ("bucket", "ZeRO, bucket view on"),
            ("overlap", "ZeRO overlap, hook_with_zero_step"),
            ("overlap_interleaved", "ZeRO overlap, interleaved hook")]
#: The settings that compare with PyTorch's ZeRO (``--all`` adds the others).
MAIN_SETTINGS = ("plain", "bucket", "overlap")


def impls_of(setting: str) -> list[str]:
    if setting == "ddp":
        return ["plain"]
    return ["ours"] if setting == "overlap_interleaved" else ["ours", "torch"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--settings", nargs="+", default=None, help="setting names (default: the ZeRO ones)")
    parser.add_argument("--all", action="store_true", help="also DDP + Adam and our interleaved hook")
    parser.add_argument("--mem-runs", type=int, default=1, help="fresh runs per peak RSS figure (median)")
    add_heap_option(parser)
    args = parser.parse_args()
    chosen = args.settings or [name for name, _ in SETTINGS if args.all or name in MAIN_SETTINGS]
    params = sum(p.numel() for p in _model().parameters())
    print(f"model: {DEPTH} x Linear({WIDTH}, {WIDTH}) = {params / 1e6:.1f}M params, batch {BATCH}, Gloo, "
          f"1 thread per rank, DDP bucket_cap_mb={BUCKET_CAP_MB}, {os.cpu_count()} cores; times: median (fastest) "
          f"of {args.iters} alternated iterations, max over ranks; ratios: of the medians (median of the "
          f"per-iteration ratios)\n")
    print("| ranks | setting | impl | step ms | iteration ms | peak RSS MiB/rank | optim state MiB/rank "
          "| state / (total/W) | step ours/torch | iter ours/torch | RSS ours/torch | host share ours/torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world in args.world:
        for setting, label in SETTINGS:
            if setting in chosen:
                _rows(world, setting, label + (" (oversubscribed)" if world > (os.cpu_count() or 1) else ""),
                      args.iters, args.mem_runs, args.fixed_heap)


def _memory(impl: str, setting: str, world: int, runs: int, fixed: bool) -> dict[str, float]:
    """Worst-rank memory over ``runs`` fresh process groups, with the median of their peak RSS."""
    with fixed_heap(fixed):
        worst = [worst_rank(run_distributed(memory_alone, impl, setting, world_size=world, fresh=True,
                                            timeout=1200)) for _ in range(runs)]
    return {**worst[0], **{key: statistics.median(w[key] for w in worst) for key in ("rss", "share")}}


def _rows(world: int, setting: str, label: str, iters: int, mem_runs: int, fixed: bool) -> None:
    impls = impls_of(setting)
    times = worst_rank(run_distributed(time_side_by_side, setting, impls, iters, world_size=world,
                                       fresh=True, timeout=1200))
    memory = {impl: _memory(impl, setting, world, mem_runs, fixed) for impl in impls}
    overlap = setting.startswith("overlap")
    for impl in impls:
        t, m = times[impl], memory[impl]
        step = "(in backward)" if overlap else f"{t['step'] * 1e3:.1f} ({t['step_min'] * 1e3:.1f})"
        ratio_step = ratio_iter = ratio_rss = ratio_share = "-"
        if impl == "ours" and "torch" in times:
            ratio_step = "-" if overlap else f"{t['step'] / times['torch']['step']:.2f} ({t['pair_step']:.2f})"
            ratio_iter = f"{t['iter'] / times['torch']['iter']:.2f} ({t['pair_iter']:.2f})"
            ratio_rss = f"{m['rss'] / memory['torch']['rss']:.3f}"
            ratio_share = f"{m['share'] / memory['torch']['share']:.3f}"
        share = "-" if setting == "ddp" else f"{m['state'] / (m['full_state'] / world):.3f}"
        print(f"| {world} | {label} | {impl} | {step} | {t['iter'] * 1e3:.1f} ({t['iter_min'] * 1e3:.1f}) | "
              f"{m['rss']:.0f} | {m['state'] / 2**20:.1f} | {share} | {ratio_step} | {ratio_iter} | {ratio_rss} "
              f"| {ratio_share} |",
              flush=True)


if __name__ == "__main__":
    main()
