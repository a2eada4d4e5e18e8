"""``make demo``: train the byte-level LM on 2 ranks, stop, and resume it on 1 rank under another strategy.

1. ``tprun --nproc-per-node 2 examples/train_lm.py --strategy fully_shard --stop-at K``: parameters,
   gradients and AdamW state sharded over two processes; a DCP checkpoint at step K, as if preempted.
2. ``python examples/train_lm.py --strategy ddp --resume .../step_K``: one process (a group of one)
   loads that sharded checkpoint into an unsharded model and optimizer and trains to the end.

The second run's loss curve (runs/demo/loss.png) continues the first one's: one colour per segment.
``--tiny`` runs the same two steps on a toy configuration (the test suite's smoke test).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
TRAIN = str(HERE / "train_lm.py")
TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--val-every", "3", "--val-batches", "1", "--sample-bytes", "16", "--warmup", "2", "--lr", "1e-2"]


def run(cmd: list[str], threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    shown = ["python" if c == sys.executable else os.path.relpath(c) if c.endswith(".py") else c for c in cmd]
    print("$ " + " ".join(shown), flush=True)
    subprocess.run(cmd, env=env, check=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stop-at", type=int, default=125)
    p.add_argument("--resume-strategy", default="ddp")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for the smoke test")
    args, extra = p.parse_known_args(argv)
    common = ["--steps", str(args.steps), *(TINY if args.tiny else []), *extra]
    first, second = Path(args.out) / "fully_shard_x2", Path(args.out)
    cores = os.cpu_count() or 1
    start = time.perf_counter()
    run([sys.executable, "-m", "tensorplay.distributed.run", "--nproc-per-node", "2", TRAIN,
         "--strategy", "fully_shard", "--stop-at", str(args.stop_at), "--out", str(first), *common],
        threads=max(cores // 2, 1))
    checkpoint = first / "checkpoints" / f"step_{args.stop_at:06d}"
    print(f"\n[demo] stopped at step {args.stop_at}; resuming on 1 rank under --strategy {args.resume_strategy}\n",
          flush=True)
    run([sys.executable, TRAIN, "--strategy", args.resume_strategy, "--resume", str(checkpoint),
         "--out", str(second), *common], threads=cores)
    final = second / "checkpoints" / f"step_{args.steps:06d}"
    print(f"\n[demo] done in {time.perf_counter() - start:.0f} s")
    print(f"[demo] loss curve (both runs): {second / 'loss.png'}")
    print(f"[demo] checkpoints: {checkpoint} (2 ranks, fully_shard) and {final} (1 rank, "
          f"{args.resume_strategy})")


if __name__ == "__main__":
    main()
