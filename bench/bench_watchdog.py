"""Collective watch overhead: step time with the watch on vs off, fully_shard and ZeRO, 2 Gloo ranks.

The same model trains in three process groups of the same two ranks: one
with the watch off, one with the defaults (records, bounded waits, heartbeat,
a store fingerprint every 8 collectives) and one that fingerprints every
collective. Steps of the three alternate (``interleaved_median_ms``), so the
machine's load hits them alike; the table shows the slower rank's medians and
the on / off ratios, for several rounds (the spread is the noise). Each step
starts after a barrier; each variant goes first in turn. Because a loaded
machine's noise can exceed a few percent, the table also gives the wall time
spent inside the watch's per-collective calls (record, fingerprint, compare)
as a share of the step: the direct cost, which load inflates alike.

    .venv/bin/python bench/bench_watchdog.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from _timing import interleaved_median_ms  # bench/ is on sys.path when run as a script
from tensorplay.testing.distributed import run_distributed

WIDTH, DEPTH, BATCH = 512, 8, 32
VARIANTS = {"off": {"enabled": False}, "on": {}, "on, fingerprint every collective": {"fingerprint_every": 1}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _fully_shard_step(group: object) -> Callable[[], None]:
    from torch.distributed.device_mesh import DeviceMesh

    from tensorplay.distributed.fsdp import fully_shard

    model = _model()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _training_step(model, torch.optim.Adam(model.parameters(), lr=1e-4))


def _training_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> Callable[[], None]:
    batch = torch.randn(BATCH, WIDTH)

    def step() -> None:
        model(batch).sum().backward()
        optim.step()
        optim.zero_grad()

    return step


def _zero_step(group: object) -> Callable[[], None]:
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    model = _model()
    return _training_step(model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                                         process_group=group, lr=1e-4))


def _time_watch_calls(totals: dict[str, float]) -> None:
    """Add the wall time spent inside the watch's per-collective methods to ``totals["watch"]``."""
    import time

    from tensorplay.distributed._comm.watch import GroupWatch

    for name in ("begin", "fingerprint", "verify"):
        method = getattr(GroupWatch, name)

        def timed(self: object, *args: object, _method: Callable[..., object] = method) -> object:
            start = time.perf_counter()
            try:
                return _method(self, *args)
            finally:
                totals["watch"] += (time.perf_counter() - start) * 1e3

        setattr(GroupWatch, name, timed)


def measure(rounds: int, iters: int) -> dict[str, list[dict[str, float]]]:
    import tensorplay.distributed as dist
    from tensorplay.distributed._comm import watch

    totals = {"watch": 0.0}
    _time_watch_calls(totals)

    groups = {}
    for name, options in VARIANTS.items():
        groups[name] = dist.new_group([0, 1])
        watch.configure(groups[name], **options)
    results: dict[str, list[dict[str, float]]] = {}
    for front_end, build in (("fully_shard", _fully_shard_step), ("ZeRO", _zero_step)):
        steppers = {name: _after_barrier(build(group)) for name, group in groups.items()}
        results[front_end] = []
        for index in range(rounds):  # each variant goes first in turn
            names = list(steppers)[index % len(steppers):] + list(steppers)[:index % len(steppers)]
            results[front_end].append(interleaved_median_ms({n: steppers[n] for n in names}, warmup=3, iters=iters))
        totals["watch"] = 0.0
        on = steppers["on"]
        start = time.perf_counter()
        for _ in range(iters):
            on()
        step_ms = (time.perf_counter() - start) * 1e3
        results[front_end].append({"inside": totals["watch"] / iters, "step": step_ms / iters})
    return results


def _after_barrier(step: Callable[[], None]) -> Callable[[], None]:
    """The ranks start each step together (a barrier in an unwatched group), so one step's skew is not the next's."""
    import tensorplay.distributed as dist

    def run() -> None:
        dist.barrier()
        step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    per_rank = run_distributed(measure, args.rounds, args.iters, world_size=2, timeout=1800)
    print(f"### Collective watch overhead, 2 Gloo ranks, {DEPTH} x Linear({WIDTH}), batch {BATCH}, Adam "
          "(median step ms, slower rank)\n")
    print("| front end | round | off | on | on / off | fingerprint every collective | that / off |")
    print("|---|---|---|---|---|---|---|")
    for front_end in per_rank[0]:
        for index in range(args.rounds):
            worst = {k: max(rank[front_end][index][k] for rank in per_rank) for k in VARIANTS}
            every = worst["on, fingerprint every collective"]
            print(f"| {front_end} | {index + 1} | {worst['off']:.1f} | {worst['on']:.1f} "
                  f"| {worst['on'] / worst['off']:.3f} | {every:.1f} | {every / worst['off']:.3f} |")
    print("\nWall time inside the watch's per-collective calls (record, fingerprint, compare), defaults, "
          "as a share of the step (slower rank):\n")
    for front_end in per_rank[0]:
        share = max(rank[front_end][-1]["inside"] / rank[front_end][-1]["step"] for rank in per_rank)
        inside = max(rank[front_end][-1]["inside"] for rank in per_rank)
        print(f"- {front_end}: {inside:.2f} ms per step, {share:.2%}")


if __name__ == "__main__":
    main()
