"""DDP with our allreduce_hook (shared-memory sum inside the hook) against DDP without a hook, several buckets.

Our DDP hooks sum buckets from 64 KiB through shared memory inside the hook and return a completed
future, so a bucket's communication no longer runs beside the rest of backward as Gloo's asynchronous
all-reduce does. This measures whether that costs: a 2M-parameter MLP (8 Linear 512x512) in buckets of
1 MiB (about 8 buckets), SGD, at 2 and 4 Gloo ranks; plain DDP, DDP + our ``allreduce_hook``, and DDP +
PyTorch's ``allreduce_hook`` step round-robin (bench/_timing.py). The table shows the slowest rank's
median step and the ratios to plain DDP.

    .venv/bin/python bench/bench_ddp_hook_overlap.py [--world 2 4]
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

from _timing import interleaved_median_ms  # bench/ is on sys.path when run as a script
from bench_comm_hooks import ddp_stepper
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks as our_hooks
from tensorplay.testing.distributed import run_distributed

DEPTH, BUCKET_MB = 8, 1
WARMUP, ITERS, ROUNDS = 3, 10, 3


def bench_rank() -> dict[str, float]:
    torch.set_num_threads(1)
    steppers = {name: ddp_stepper(hook, None, depth=DEPTH, bucket_cap_mb=BUCKET_MB) for name, hook in (
        ("DDP, no hook", None), ("DDP + our allreduce_hook", our_hooks.allreduce_hook),
        ("DDP + PyTorch's allreduce_hook", torch_hooks.allreduce_hook))}
    return interleaved_median_ms(steppers, warmup=WARMUP, iters=ITERS, rounds=ROUNDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print("| ranks | setting | ms/step (slowest rank) | vs no hook |")
    print("|---|---|---|---|")
    for world in args.world:
        per_rank = run_distributed(bench_rank, world_size=world, timeout=900)
        slowest = {name: max(times[name] for times in per_rank) for name in per_rank[0]}
        plain = slowest["DDP, no hook"]
        for name, ms in slowest.items():
            print(f"| {world} | {name} | {ms:.1f} | {ms / plain:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
