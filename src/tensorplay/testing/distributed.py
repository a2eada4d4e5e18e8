"""Run a function on N local ranks, each a real process in a Gloo group.

    from tensorplay.testing.distributed import run_distributed

    def check_all_reduce():            # module level, so it can be pickled
        t = tp.ones(2) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t

    results = run_distributed(check_all_reduce, world_size=2)   # [rank0's, rank1's]

Workers are spawned once per (world size, backend) and reused by later calls, so
a suite of many multi-rank tests pays the 2-3 s torch import once, not per test.
Each call runs ``fn(*args, **kwargs)`` on every rank inside the already
initialised default process group and returns the per-rank results in rank
order. A rank that raises fails the call with a :class:`RankFailure` carrying
that rank's traceback; a call that does not finish within ``timeout`` seconds
fails with a :class:`RankTimeout` naming the ranks still running. Either way the
workers are killed (none is left blocked in a collective) and the next call
starts a fresh group.

:func:`run_rpc` is the variant for RPC: fresh processes, ``init_rpc`` as
``worker{rank}`` over TensorPipe on loopback, ``fn`` on every rank, then a
graceful ``rpc.shutdown``.

Functions must not destroy the default group. Tests that expect an error should
catch it inside ``fn`` and return what they need to check: a raised error
discards the workers, and the next call pays for new ones.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["RankFailure", "RankTimeout", "free_port", "run_distributed", "run_rpc", "shutdown_workers"]

DEFAULT_TIMEOUT_S = 180.0
#: After one rank fails, how long the others get to report before they are killed.
FAILURE_GRACE_S = 3.0


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        ranks = ", ".join(str(r) for r in sorted(failures))
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"rank(s) {ranks} failed:\n{details}")


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the timeout (a hang or a dead peer)."""

    def __init__(self, pending: list[int], timeout: float, finished_with_error: dict[int, str]) -> None:
        self.pending = pending
        msg = f"rank(s) {pending} did not finish within {timeout:.0f}s (hung in a collective or blocked)"
        if finished_with_error:
            msg += "; meanwhile " + str(RankFailure(finished_with_error))
        super().__init__(msg)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _WorkerConfig:
    rank: int
    world_size: int
    port: int
    backend: str
    rpc: bool
    timeout_s: float


def _worker_main(config: _WorkerConfig, conn: Connection) -> None:
    """Entry point of a spawned rank: set up the group, then serve jobs until told to stop."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(
        RANK=str(config.rank), LOCAL_RANK=str(config.rank), WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config.port),
    )
    import torch

    torch.set_num_threads(1)
    _initialise(config)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            break
        try:
            fn, args, kwargs = _unpack_job(job)
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            conn.send(("error", traceback.format_exc()))
    _finalise(config)


_Job = tuple[list[str], bytes]


def _pack_job(fn: Callable[..., Any], args: tuple, kwargs: dict) -> _Job:
    return list(sys.path), pickle.dumps((fn, args, kwargs))


def _unpack_job(job: _Job) -> tuple[Callable[..., Any], tuple, dict]:
    # The parent's sys.path first: test modules imported after the spawn must resolve.
    sys_path, payload = job
    sys.path[:0] = [entry for entry in sys_path if entry not in sys.path]
    return pickle.loads(payload)


def _initialise(config: _WorkerConfig) -> None:
    import tensorplay.distributed as dist

    init_method = f"tcp://127.0.0.1:{config.port}"
    timeout = timedelta(seconds=config.timeout_s)
    if config.rpc:
        from tensorplay.distributed import rpc

        options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=config.timeout_s)
        rpc.init_rpc(f"worker{config.rank}", rank=config.rank, world_size=config.world_size,
                     rpc_backend_options=options)
    else:
        dist.init_process_group(config.backend, init_method=init_method, rank=config.rank,
                                world_size=config.world_size, timeout=timeout)


def _finalise(config: _WorkerConfig) -> None:
    import tensorplay.distributed as dist

    if config.rpc:
        from tensorplay.distributed import rpc

        rpc.shutdown()
    elif dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class _WorkerPool:
    """``world_size`` spawned ranks, each with a pipe to the parent."""

    world_size: int
    backend: str
    rpc: bool
    processes: list[mp.Process] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)

    def start(self, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            config = _WorkerConfig(rank, self.world_size, port, self.backend, self.rpc, timeout_s)
            process = ctx.Process(target=_worker_main, args=(config, child_end), daemon=True,
                                  name=f"tensorplay-rank{rank}")
            process.start()
            child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)

    def run(self, job: _Job, timeout_s: float) -> list[Any]:
        for conn in self.conns:
            conn.send(job)
        return self._collect(timeout_s)

    def _collect(self, timeout_s: float) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        while pending:
            if failures:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            remaining = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(remaining, 0)) if remaining > 0 else []
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    code = self.processes[rank].exitcode
                    failures[rank] = f"process died (exit code {code}) before reporting a result"
                    continue
                (results if status == "ok" else failures)[rank] = payload
        if pending and not failures:
            raise RankTimeout(sorted(pending.values()), timeout_s, failures)
        if failures:
            raise RankFailure(failures)
        return [results[rank] for rank in range(self.world_size)]

    def stop(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for process in self.processes:
                process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()


_POOLS: dict[tuple[int, str], _WorkerPool] = {}


def _run(pool: _WorkerPool, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float, keep: bool) -> list[Any]:
    job = _pack_job(fn, args, kwargs)
    try:
        results = pool.run(job, timeout)
    except BaseException:
        pool.stop(graceful=False)
        _POOLS.pop((pool.world_size, pool.backend), None)
        raise
    if not keep:
        pool.stop(graceful=True)
    return results


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``fn`` must be picklable (a module-level function). ``fresh=True`` uses new
    processes for this call only, for tests that must not share a group.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    key = (world_size, backend)
    pool = None if fresh else _POOLS.get(key)
    if pool is None or any(not p.is_alive() for p in pool.processes):
        if pool is not None:
            pool.stop(graceful=False)
        pool = _WorkerPool(world_size, backend, rpc=False)
        pool.start(timeout)
        if not fresh:
            _POOLS[key] = pool
    return _run(pool, fn, args, kwargs, timeout, keep=not fresh)


def run_rpc(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` fresh RPC workers named ``worker0`` ... (TensorPipe, loopback)."""
    pool = _WorkerPool(world_size, backend="tensorpipe", rpc=True)
    pool.start(timeout)
    return _run(pool, fn, args, kwargs, timeout, keep=False)


@atexit.register
def shutdown_workers() -> None:
    """Stop every pooled worker (also run at interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.stop(graceful=True)
