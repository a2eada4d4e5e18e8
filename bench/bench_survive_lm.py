"""examples/train_lm.py --survive with a rank SIGKILLed at 10 random moments of a 300-step run, against the
same run uninterrupted.

Both runs go through ``python -m tensorplay.distributed.run --survive --nproc-per-node 4 --max-restarts 10``
(the launcher starts a replacement for every dead worker; it joins at a step boundary). The kills come from
the example's test hook ``TENSORPLAY_KILL_AT=step:rank:moment,...``: steps drawn by ``--seed`` at least
``--min-gap`` apart, the rank (of the world at that step) and the moment (forward, backward, commit, or inside
the optimizer step after the ranks agreed) too. Per kill: the world then, the seconds from the kill to the
next step completed by every survivor, and the world after it; then both runs' final loss and the largest
difference of the two loss curves. Group timeout 8 s, ``TENSORPLAY_STALL_S=1``.

    .venv/bin/python bench/bench_survive_lm.py [--strategy fully_shard|ddp] [--steps 300] [--kills 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOMENTS = ("forward", "backward", "commit", "optimizer")


def plan(steps: int, kills: int, seed: int, min_gap: int) -> list[tuple[int, int, str]]:
    rng = random.Random(seed)
    while True:
        chosen = sorted(rng.sample(range(5, steps - 5), kills))
        if all(b - a >= min_gap for a, b in zip(chosen, chosen[1:], strict=False)):
            return [(step, rng.randrange(4), rng.choice(MOMENTS)) for step in chosen]


def launch(out: Path, args: argparse.Namespace, kill_at: str) -> float:
    model = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "64", "--batch-size", "16",
             "--steps", str(args.steps), "--warmup", "15", "--lr", "3e-3", "--no-progress", "--no-plot"]
    command = [sys.executable, "-m", "tensorplay.distributed.run", "--survive", "--nproc-per-node", "4",
               "--max-restarts", "10", str(ROOT / "examples/train_lm.py"), "--survive", "--strategy", args.strategy,
               "--survive-timeout", "8", "--out", str(out), *model]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "TENSORPLAY_STALL_S": "1",
           "TENSORPLAY_KILL_AT": kill_at}
    begin = time.perf_counter()
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode:
        sys.exit(f"the run failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fully_shard", choices=("fully_shard", "ddp"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-gap", type=int, default=15)
    args = parser.parse_args()
    kills = plan(args.steps, args.kills, args.seed, args.min_gap)
    with tempfile.TemporaryDirectory() as directory:
        wall_plain = launch(Path(directory) / "plain", args, "")
        wall = launch(Path(directory) / "survive", args, ",".join(f"{s}:{r}:{m}" for s, r, m in kills))
        plain = json.loads((Path(directory) / "plain/log.json").read_text())["train"]
        ours = json.loads((Path(directory) / "survive/log.json").read_text())["train"]
        records = [json.loads(line) for line in (Path(directory) / "survive/survive_steps.jsonl").read_text()
                   .splitlines()]
    print(f"## train_lm --survive --strategy {args.strategy}: 4 ranks, {args.steps} steps, "
          f"{len(kills)} SIGKILLs (seed {args.seed})\n")
    print("| kill | step | rank | moment | world then | s to the next completed step | world after |")
    print("|---|---|---|---|---|---|---|")
    done = [r for r in records if "step" in r]
    for index, kill in enumerate(sorted((r for r in records if "kill" in r), key=lambda r: r["time"])):
        after = [r for r in done if r["time"] > kill["time"] and r["step"] > kill["kill"]]
        first = min(r["step"] for r in after)
        ranks = [r for r in after if r["step"] == first]
        print(f"| {index + 1} | {kill['kill']} | {kill['rank']} | {kill['moment']} | {kill['world']} | "
              f"{max(r['time'] for r in ranks) - kill['time']:.1f} | {ranks[0]['world']} |")
    diff = max(abs(a[1] - b[1]) for a, b in zip(ours, plain, strict=True))
    print(f"\n| run | steps | final loss | wall s |\n|---|---|---|---|\n| uninterrupted | {len(plain)} | "
          f"{plain[-1][1]:.6f} | {wall_plain:.0f} |\n| {len(kills)} SIGKILLs | {len(ours)} | {ours[-1][1]:.6f} | "
          f"{wall:.0f} |\n\nmax abs diff of the loss curve against the uninterrupted run: {diff:.1e}")


if __name__ == "__main__":
    main()
