"""Failure latency: seconds until every rank waiting on a failing peer raised, against the group's timeout.

Each front end (fully_shard, classic FSDP, ZeRO, the periodic averager, DDP with our allreduce hook) trains
on 2 fresh Gloo ranks in a group made with ``timeout=`` 4 s; at step 1 the last rank, inside its forward,
raises and lives on, exits normally, is SIGKILLed, sleeps, or issues another collective of ours; or, before
the first step, the other rank loads a state dict while the peer does not. Both transports: shared memory
(default) and Gloo (``TENSORPLAY_SHM=0``). A cell gives, for the waiting rank, the seconds from the peer's
deviation to its ``CollectiveDivergence`` (``named``: it names the peer and both sites) and to its exit.
The scenarios are ``tests/parity/timeout_cases.py``; a sample runs in ``make test``.

    .venv/bin/python bench/bench_timeouts.py [--front-ends fully_shard zero] [--behaviours raise kill]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.parity import timeout_cases as cases  # noqa: E402 - the repository root is on sys.path now

TRANSPORTS = {"shared memory": {}, "Gloo": {"TENSORPLAY_SHM": "0"}}


def cell(outcome: dict, rank: int) -> str:
    status, message, seconds = outcome["results"].get(rank, ("no report", "", None))
    code, ended = outcome["exits"][rank]
    exit_text = f"exit {code} at {ended:.1f} s" if ended is not None else "still running (the bench kills it)"
    if status != "raised":
        return f"{status}; {exit_text}"
    named = "named" if "CollectiveDivergence" in message else "unnamed: " + message.splitlines()[0][:60]
    return f"raised at {seconds:.1f} s ({named}); {exit_text}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--front-ends", nargs="+", default=list(cases.FRONT_ENDS))
    parser.add_argument("--behaviours", nargs="+", default=[*cases.BEHAVIOURS, "skip_load"])
    args = parser.parse_args()
    print(f"## Failure latency (group timeout {cases.GROUP_TIMEOUT_S:g} s, 2 ranks; the waiting rank, "
          "and the peer where it waits too)\n")
    print("| front end | peer | transport | waiting rank 0 | rank 1 (the peer) |")
    print("|---|---|---|---|---|")
    for front_end in args.front_ends:
        for behaviour in args.behaviours:
            if behaviour == "skip_load" and front_end not in ("fully_shard", "classic"):
                continue
            for transport, env in TRANSPORTS.items():
                outcome = cases.spawn(front_end, behaviour, env=env)
                print(f"| {front_end} | {behaviour} | {transport} | {cell(outcome, 0)} | {cell(outcome, 1)} |",
                      flush=True)


if __name__ == "__main__":
    main()
