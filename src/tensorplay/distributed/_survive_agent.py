"""``tprun --survive``: the launcher holds the rendezvous store; a dead worker is replaced, the others carry on.

[Note: survive mode's launcher]
One host. The launcher process (never a rank) hosts the rendezvous TCPStore, so
the store outlives any worker, rank 0 included. Each worker gets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True`` (so that
``init_process_group("env://")`` connects to the store as a client instead of
hosting one in rank 0) and ``TENSORPLAY_SURVIVE=1`` (the ranks' watch answers
probes: nobody ends the job when one dies). When a worker ends with a non-zero
code or a signal, the launcher says so in one line on stderr, leaves the others
running, and while ``--max-restarts`` allows starts a replacement with the
same environment plus ``TENSORPLAY_SURVIVE_JOIN=1``: its ``RANK`` is only the
slot it fills, it joins the survivors through the store. The job ends when
every worker has ended: exit code 0 when the last worker of every slot exited
with 0, else 1. SIGINT / SIGTERM stop every worker (SIGTERM, SIGKILL after
:data:`STOP_GRACE_S`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

__all__ = ["JOIN_ENV", "STOP_GRACE_S", "SURVIVE_ENV", "SurviveAgent", "check_survive_args", "exit_words",
           "launch"]

SURVIVE_ENV = "TENSORPLAY_SURVIVE"
JOIN_ENV = "TENSORPLAY_SURVIVE_JOIN"
STOP_GRACE_S = 10.0  # after SIGINT / SIGTERM, how long workers have to exit before they are SIGKILLed


def check_survive_args(args: Any) -> str | None:
    """Why ``args`` cannot run in survive mode (a sentence naming the flag), or None when they can."""
    try:
        nodes = parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        nodes = None
    if nodes != (1, 1):
        return (f"--survive runs on one host for now: --nnodes must be 1, got {args.nnodes!r} (the store lives in "
                "the launcher, and a lost host that runs it is not survived yet; see docs/launching.md)")
    unused = {"--rdzv-backend": args.rdzv_backend != "static", "--rdzv-endpoint": bool(args.rdzv_endpoint),
              "--redirects": args.redirects != "0", "--tee": args.tee != "0", "--log-dir": bool(args.log_dir)}
    given = [flag for flag, set_ in unused.items() if set_]
    if given:
        return (f"--survive does not take {', '.join(given)}: the launcher hosts the store itself and the workers "
                "write to its own stdout and stderr")
    return None


def exit_words(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Worker:
    """One worker process and the slot (local rank) it fills."""

    local_rank: int
    process: subprocess.Popen
    joined: bool  # a replacement: it joins the survivors through the store


class SurviveAgent:
    """Starts ``nproc`` workers of ``command`` around a store it hosts; replaces the ones that die."""

    def __init__(self, command: list[str], nproc: int, max_restarts: int, host: str = "127.0.0.1", port: int = 0,
                 monitor_s: float = 0.1) -> None:
        self.command, self.nproc, self.restarts_left = command, nproc, max_restarts
        self.max_restarts, self.monitor_s = max_restarts, monitor_s
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True)
        self.host = host
        self.running: list[Worker] = []
        self.last_codes: dict[int, int] = {}  # slot -> exit code of the last worker that filled it
        self._stopping: int | None = None  # the signal that asked the job to stop

    def env(self, local_rank: int, joined: bool) -> dict[str, str]:
        """The environment of the worker filling slot ``local_rank`` (see [Note: survive mode's launcher])."""
        env = dict(os.environ, RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(self.nproc),
                   LOCAL_WORLD_SIZE=str(self.nproc), GROUP_RANK="0", MASTER_ADDR=self.host,
                   MASTER_PORT=str(self.store.port), TORCHELASTIC_USE_AGENT_STORE="True", **{SURVIVE_ENV: "1"})
        if self.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun
        if joined:
            env[JOIN_ENV] = "1"
        return env

    def start(self, local_rank: int, joined: bool = False) -> Worker:
        worker = Worker(local_rank, subprocess.Popen(self.command, env=self.env(local_rank, joined)), joined)
        self.running.append(worker)
        return worker

    def run(self) -> int:
        """Start the workers and watch them until every one has ended; the job's exit code."""
        for local_rank in range(self.nproc):
            self.start(local_rank)
        while self.running:
            if self._stopping is not None:
                return self.stop()
            for worker in [w for w in self.running if w.process.poll() is not None]:
                self._ended(worker)
            time.sleep(self.monitor_s)
        return 0 if all(code == 0 for code in self.last_codes.values()) else 1

    def _ended(self, worker: Worker) -> None:
        """A worker ended: record it; one that failed is named on stderr and replaced while restarts are left."""
        self.running.remove(worker)
        code = worker.process.returncode
        self.last_codes[worker.local_rank] = code
        if code == 0:
            return
        name = f"tprun: rank {worker.local_rank} (local_rank {worker.local_rank}, pid {worker.process.pid})"
        if self.restarts_left > 0:
            self.restarts_left -= 1
            replacement = self.start(worker.local_rank, joined=True)
            then = (f"starting a replacement (pid {replacement.process.pid}, {JOIN_ENV}=1; {self.restarts_left} "
                    f"of {self.max_restarts} restarts left)")
        else:
            then = f"no restarts left (--max-restarts {self.max_restarts}): the job goes on without it"
        print(f"{name} {exit_words(code)}; the other workers carry on; {then}", file=sys.stderr, flush=True)

    def ask_to_stop(self, signum: int, _frame: FrameType | None = None) -> None:
        self._stopping = signum

    def stop(self) -> int:
        """Stop every running worker: SIGTERM, then SIGKILL after the grace; the exit code of a signalled job."""
        signum = self._stopping or signal.SIGTERM
        print(f"tprun: {signal.Signals(signum).name} received: stopping {len(self.running)} worker(s)",
              file=sys.stderr, flush=True)
        for worker in self.running:
            worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in self.running:
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        self.running.clear()
        return 128 + signum


def launch(args: Any) -> int:
    """Run ``args`` (tprun's, already checked with :func:`check_survive_args`) in survive mode; the exit code."""
    if args.no_python:
        command = [args.training_script]
    else:
        command = [sys.executable, "-u", *(["-m"] if args.module else []), args.training_script]
    agent = SurviveAgent(command + list(args.training_script_args), determine_local_world_size(args.nproc_per_node),
                         args.max_restarts, args.master_addr or "127.0.0.1", args.master_port or 0,
                         args.monitor_interval)
    handlers = {signum: signal.signal(signum, agent.ask_to_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return agent.run()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
