"""Run a function on N local ranks of a job that can lose ranks: the store lives in the calling process.

    from tensorplay.testing.survive import die, run_survivable

    def train(kill_at):                       # module level, so it can be pickled
        job = survive.Job(build, sampler)     # connects to the test's store through MASTER_ADDR/PORT
        ...                                   # a rank calls die() at a chosen moment
        return result

    outcome = run_survivable(train, kill_at, world_size=4)   # outcome[rank]: its result, or Died

Each rank is a fresh spawned process with the launcher's contract in its environment (``MASTER_ADDR`` /
``MASTER_PORT`` of a :class:`TCPStore` hosted here, ``TORCHELASTIC_USE_AGENT_STORE=True``,
``TENSORPLAY_SURVIVE=1``, ``RANK`` / ``WORLD_SIZE`` of the first generation). A rank that dies (SIGKILL)
is a :class:`Died` in the result; one that raises fails the call with its traceback; one that does not
finish within ``timeout`` seconds fails it with the ranks still running, and every process is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from .distributed import RankFailure, RankTimeout, _pack_job, _unpack_job, free_port

__all__ = ["Died", "die", "run_survivable"]


@dataclass(frozen=True)
class Died:
    """A rank that ended without a result (killed, or exited)."""

    exitcode: int | None


def die() -> None:
    """End this process at once, as a lost host or an out-of-memory kill would (no cleanup, no exit notice)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_main(rank: int, world: int, port: int, env: dict[str, str], job: Any, conn: Connection) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True", TENSORPLAY_SURVIVE="1")
    if rank >= world:  # a replacement: its RANK means nothing, it joins through the store
        os.environ["TENSORPLAY_SURVIVE_JOIN"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    torch.set_num_threads(1)
    try:
        fn, args, kwargs = _unpack_job(job)
        # plain pickle: torch's reductions would share tensors through memory that ends with this process
        conn.send(("ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        conn.send(("error", traceback.format_exc()))


def run_survivable(fn: Callable[..., Any], *args: Any, world_size: int, joiners: int = 0, timeout: float = 60.0,
                   env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks over a store hosted here, and on ``joiners``
    replacements started at once with ``TENSORPLAY_SURVIVE_JOIN=1`` (``fn`` decides when they join); return
    each process's result (or :class:`Died`): the first generation's ranks in order, then the replacements."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    job = _pack_job(fn, args, kwargs)
    processes, conns = [], []
    for rank in range(world_size + joiners):
        parent_end, child_end = ctx.Pipe()
        process = ctx.Process(target=_rank_main, args=(rank, world_size, port, env or {}, job, child_end),
                              daemon=True, name=f"tensorplay-survive{rank}")
        process.start()
        child_end.close()
        processes.append(process)
        conns.append(parent_end)
    try:
        return _collect(processes, conns, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        for conn in conns:
            conn.close()
        del store


def _collect(processes: list[mp.Process], conns: list[Connection], timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = {conn: rank for rank, conn in enumerate(conns)}
    deadline = time.monotonic() + timeout
    while pending:
        ready = wait(list(pending), timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            raise RankTimeout(sorted(pending.values()), timeout, failures)
        for conn in ready:
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                processes[rank].join(timeout=5)
                results[rank] = Died(processes[rank].exitcode)
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
    if failures:
        raise RankFailure(failures)
    return [results[rank] for rank in range(len(conns))]
