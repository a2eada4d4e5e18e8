"""Detection latency of a rank blocked outside our collectives, against one that computes (issue 42, item 5).

ZeRO over a DDP model on 2 fresh Gloo ranks, group ``timeout=`` 60 s. In step 1 rank 1 either skips its ZeRO
step (it goes on to step 2 and waits in DDP's own all-reduce, which the watch does not see, while rank 0 waits
for it in ZeRO's broadcast) or computes for six of the watch's slices before it. A row gives how rank 0's
wait ended: the seconds it waited before it raised (from its message) or that it finished, with the idle
signal on (the default) and off (``TENSORPLAY_IDLE_S=off``: the behaviour before it, named at the timeout).
The scenarios are ``tests/comm/watch_cases.py``; ``tests/comm/test_collective_watch.py`` runs them at 0.5 s
slices.

    .venv/bin/python bench/bench_detection.py [--stall-s 5] [--scenarios skip skip_off compute]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.comm import watch_cases as cases  # noqa: E402 - the repository root is on sys.path now

GROUP_TIMEOUT_S = 60.0
SCENARIOS = {
    "skip": ("rank 1 skips a ZeRO step (waits in DDP's all-reduce)", cases.zero_under_ddp_skip_step, {}),
    "skip_off": ("the same, idle signal off", cases.zero_under_ddp_skip_step, {"TENSORPLAY_IDLE_S": "off"}),
    "compute": (f"rank 1 computes for {cases.COMPUTE_SLICES} slices", cases.zero_under_ddp_peer_computes, {}),
}


def outcome(result: tuple[str, object, float] | None) -> str:
    if result is None:
        return "no report (killed)"
    status, payload, _ = result
    if status != "raised":
        return status
    waited = re.search(r"rank 0 waited ([\d.]+) s", str(payload))
    named = "blocked outside tensorplay's collectives" if "blocked outside" in str(payload) else (
        "the group's timeout is up" if "timeout" in str(payload) else str(payload)[:60])
    return f"raised after waiting {waited.group(1) if waited else '?'} s ({named})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stall-s", type=float, default=5.0, help="the watch's slice (TENSORPLAY_STALL_S)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = parser.parse_args()
    print(f"## Detection under DDP (2 ranks, group timeout {GROUP_TIMEOUT_S:g} s, slices of {args.stall_s:g} s)\n")
    print("| rank 1 | rank 0's wait | wall s |")
    print("|---|---|---|")
    for name in args.scenarios:
        title, fn, env = SCENARIOS[name]
        start = time.monotonic()
        results = cases.spawn_ranks(fn, 2, GROUP_TIMEOUT_S + 60, group_timeout_s=GROUP_TIMEOUT_S,
                                    stall_s=args.stall_s, env=env)
        print(f"| {title} | {outcome(results.get(0))} | {time.monotonic() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
