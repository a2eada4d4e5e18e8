"""A worker under ``tprun --survive`` (tests/parity/test_launcher_survive.py): records what it saw, then acts.

``survive_worker.py OUT MODE`` writes ``OUT/<pid>.json`` (its rank, the survive-mode environment, what it did):

    kill0  the group forms through env:// (the store is the launcher's); rank 0 SIGKILLs itself; rank 1, once
           rank 0 is gone, writes a key to the store and reads it back; the replacement (TENSORPLAY_SURVIVE_JOIN=1)
           reads that key from the store
    exit3  rank 1 exits with code 3 at once; rank 0 waits until rank 1 is gone, then exits 0
    sleep  every worker sleeps (until the launcher is signalled)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
       "TORCHELASTIC_USE_AGENT_STORE", "TENSORPLAY_SURVIVE", "TENSORPLAY_SURVIVE_JOIN")


def record(out: Path, **seen: object) -> None:
    text = json.dumps({"pid": os.getpid(), "env": {key: os.environ.get(key) for key in ENV}, **seen})
    (out / f"{os.getpid()}.json").write_text(text)


def wait_gone(pid: int, limit_s: float = 60.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def kill0(out: Path, rank: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store_at = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if os.environ.get("TENSORPLAY_SURVIVE_JOIN") == "1":
        store = dist.TCPStore(*store_at, is_master=False, timeout=timedelta(seconds=60))
        store.wait(["written after rank 0 died"])
        record(out, read=store.get("written after rank 0 died").decode())
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env://: a client of the launcher's store
    dist.barrier()
    store = dist.TCPStore(*store_at, is_master=False, timeout=timedelta(seconds=60))
    if rank == 0:
        store.set("rank 0 pid", str(os.getpid()))
        record(out, killed=True)
        os.kill(os.getpid(), signal.SIGKILL)
    gone = wait_gone(int(store.get("rank 0 pid")))
    store.set("written after rank 0 died", f"rank {rank}")
    record(out, rank0_gone=gone, read=store.get("written after rank 0 died").decode())
    os._exit(0)  # no group teardown: its rank 0 is dead


def exit3(out: Path, rank: int) -> None:
    if rank == 1:
        (out / "rank1.pid").write_text(str(os.getpid()))
        record(out)
        sys.exit(3)
    while not (out / "rank1.pid").exists():
        time.sleep(0.05)
    record(out, outlived=wait_gone(int((out / "rank1.pid").read_text())))


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode == "kill0":
        kill0(out, rank)
    elif mode == "exit3":
        exit3(out, rank)
    else:
        record(out)
        time.sleep(600)


if __name__ == "__main__":
    main()
