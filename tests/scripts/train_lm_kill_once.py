"""examples/train_lm.py under tprun, with one rank SIGKILLing itself mid-step on the first attempt only.

    python -m tensorplay.distributed.run --nproc-per-node 4 --max-restarts 1 \\
        tests/scripts/train_lm_kill_once.py --strategy ddp --resume auto --ckpt-every 2 ...

Environment: ``TP_KILL_RANK`` (default 1) and ``TP_KILL_STEP`` (a 0-based step;
unset: never kill). The rank dies in the forward of that step (after its loss,
before its backward), while the others wait in that step's gradient all-reduce.
Only on attempt 0 (``TORCHELASTIC_RESTART_COUNT``): the restarted job runs
through. ``TP_EVENTS`` (a directory): each rank appends what it did and when
(``kill``, ``start``, ``resumed``) to ``events.jsonl`` there, for the test's timings.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record(event: str, **fields: Any) -> None:
    folder = os.environ.get("TP_EVENTS")
    if folder:
        line = json.dumps({"event": event, "rank": RANK, "attempt": ATTEMPT, "time": time.time(), **fields})
        with open(Path(folder) / "events.jsonl", "a") as log:
            log.write(line + "\n")


record("start")  # before the imports: a restart's cost includes them
sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import train_lm  # noqa: E402


def install_hooks(kill_rank: int | None, kill_step: int) -> None:
    """Wrap the recipe's step and loss: record the first step's start; kill ``kill_rank`` in step ``kill_step``."""
    original_step, original_loss = train_lm.train_step, train_lm.loss_of
    steps_run = [0]  # steps of this attempt (attempt 0 starts fresh: the step index)

    def train_step(*args: Any, **kwargs: Any) -> Any:
        if steps_run[0] == 0:
            record("first_step")
        steps_run[0] += 1
        return original_step(*args, **kwargs)

    def loss_of(*args: Any, **kwargs: Any) -> Any:
        loss = original_loss(*args, **kwargs)
        if RANK == kill_rank and steps_run[0] - 1 == kill_step:
            record("kill", step=kill_step)
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    train_lm.train_step, train_lm.loss_of = train_step, loss_of


def main() -> None:
    kill = "TP_KILL_STEP" in os.environ and ATTEMPT == 0
    install_hooks(int(os.environ.get("TP_KILL_RANK", "1")) if kill else None, int(os.environ.get("TP_KILL_STEP", -1)))
    result = train_lm.main(sys.argv[1:])
    record("done", final=result["train"][-1])


if __name__ == "__main__":
    main()
