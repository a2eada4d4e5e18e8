"""Surviving a lost rank: the fault table, and what the buddy copy costs a step.

Fault table: 4 fresh Gloo ranks train the tiny model of ``tests/parity/survive_cases.py`` under ``survive.Job``
(DDP, DDP with our allreduce hook, or 1-D fully_shard with the buddy copy) for 22 steps, with one or two ranks
SIGKILLed at step 2 at the named moment. A row gives the seconds from the kill to the next completed step (the
slowest survivor), the steps redone (1: the step in flight was abandoned and retried; 0: it had been committed), and
the largest difference of the survivors' parameters after the 20 further steps from one process training on the
whole global batch. Group timeout 8 s, ``TENSORPLAY_STALL_S=1``.

Cost: 1-D fully_shard of a 4 x 512 x 512 MLP on 2 and 4 ranks, the step's process CPU time (forward, backward,
commit) with the buddy copy on and off, alternating step by step in one job, cheapest of 30 steps each; and the
bytes the copy sends and holds per rank.

    .venv/bin/python bench/bench_survive.py [--front-ends DDP ...] [--faults forward ...] [--skip-faults] [--skip-cost]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tensorplay.distributed import survive  # noqa: E402
from tensorplay.distributed.fsdp import fully_shard  # noqa: E402
from tensorplay.testing.survive import Died, run_survivable  # noqa: E402

from tests.parity import survive_cases as cases  # noqa: E402 - the repository root is on sys.path now
from tests.parity import test_survive_ddp, test_survive_fully_shard  # noqa: E402

STEPS = 22
FRONT_ENDS = {"DDP": test_survive_ddp._job, "DDP + our allreduce_hook": lambda: test_survive_ddp._job(hook=True),
              "fully_shard + buddy": test_survive_fully_shard._job}
FAULTS = {"forward": {1: (2, "forward")}, "backward": {1: (2, "backward")}, "commit": {1: (2, "commit")},
          "optimizer step": {1: (2, "optimizer step")}, "rank 0 (forward)": {0: (2, "forward")},
          "ranks 0 and 2 (forward)": {0: (2, "forward"), 2: (2, "forward")}}


def _train(front_end: str, kills: cases.Kills) -> dict:
    return cases.train(FRONT_ENDS[front_end], kills, steps=STEPS)


def fault_row(front_end: str, fault: str, kills: cases.Kills) -> str:
    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "kills"
        env = {**cases.ENV, cases.KILL_LOG: str(log)}
        outcome = run_survivable(_train, front_end, kills, world_size=4, timeout=300, env=env)
        killed = [float(line.split()[1]) for line in log.read_text().splitlines()]
    survivors = [r for rank, r in enumerate(outcome) if rank not in kills and not isinstance(r, Died)]
    expected = cases.reference(STEPS)
    worst = max(float((ours - theirs).abs().max()) for r in survivors
                for ours, theirs in zip(r["params"], expected, strict=True))
    seconds = max(r["resumed"][0] for r in survivors) - min(killed)
    redone = 1 if survivors[0]["seen"][0][1] == 2 else 0
    return f"| {front_end} | {fault} | {len(survivors)} | {seconds:.1f} | {redone} | {worst:.1e} |"


def _big_build():
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    fully_shard(module)
    return module, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)


def _cost(steps: int) -> dict:
    job = survive.Job(_big_build, survive.Sampler(48, 480), timeout=timedelta(seconds=60), redundancy="buddy")
    x, best, buddy = torch.randn(480, 512), {"on": float("inf"), "off": float("inf")}, job._buddy
    for step in range(2 * steps):
        mode = "on" if step % 2 else "off"
        job._buddy = buddy if mode == "on" else None  # the bench switches the copy off on alternate steps
        start = time.process_time()
        with job.attempt():
            rows = job.indices()
            job.model(x[rows]).square().mean().backward()
            job.commit()
        best[mode] = min(best[mode], time.process_time() - start)
    shard = sum(p.to_local().numel() for p in job.model.parameters())
    return {**best, "sent": shard * 3 * 4, "held": shard * 3 * 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--front-ends", nargs="+", default=list(FRONT_ENDS), choices=list(FRONT_ENDS))
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    if not args.skip_faults:
        print("## Fault table (4 ranks, kill at step 2, 20 more steps; group timeout 8 s)\n")
        print("| front end | killed at | survivors | s from kill to next completed step | steps redone | "
              "max abs diff vs uninterrupted |")
        print("|---|---|---|---|---|---|")
        for front_end in args.front_ends:
            for fault in args.faults:
                print(fault_row(front_end, fault, FAULTS[fault]), flush=True)
    if not args.skip_cost:
        print("\n## The buddy copy's cost (1-D fully_shard, 4 x 512 x 512 MLP, SGD with momentum)\n")
        print("| ranks | step CPU s, copy off | copy on | on / off | bytes sent and held per rank |")
        print("|---|---|---|---|---|")
        for world in (2, 4):
            result = run_survivable(_cost, 30, world_size=world, timeout=600)[0]
            print(f"| {world} | {result['off']:.4f} | {result['on']:.4f} | {result['on'] / result['off']:.2f} | "
                  f"{result['sent'] / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
