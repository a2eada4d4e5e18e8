"""A peer that fails, and the ranks that wait on it: each front end x what the peer does x transport.

Rank 0 trains normally. At step 1, at the start of its forward of ``layers.1``
(inside the forward, after some collectives of the step), the last rank does
something else:

    raise   raises, catches it and lives on (sleeps)
    exit    raises ``SystemExit``: the interpreter exits normally (atexit, destructors)
    kill    SIGKILLs itself
    sleep   sleeps, then carries on
    other   issues a different collective of ours, then sleeps
    skip_load  (before the first step) the others load a state dict, the peer does not

Each rank runs in a fresh process (``spawn``) in a Gloo group whose ``timeout=``
is :data:`GROUP_TIMEOUT_S`; the watch keeps its defaults. Every waiting rank
reports the seconds from the peer's deviation to its error, and the error.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

import tensorplay as tp
from tensorplay.testing.distributed import free_port

GROUP_TIMEOUT_S = 4.0
PEER_SLEEP_S = 4 * GROUP_TIMEOUT_S
BEHAVIOURS = ("raise", "exit", "kill", "sleep", "other")
FRONT_ENDS = ("fully_shard", "classic", "zero", "averager", "hook")


class Net(tp.nn.Module):
    """``depth`` tanh layers of ``width`` x ``width``, seeded."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = tp.nn.ModuleList(tp.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class PeerRaised(RuntimeError):
    """The peer's own error (a user error in its forward)."""


def _deviate(behaviour: str, started: Any) -> None:
    started.value = time.time()
    if behaviour == "raise":
        raise PeerRaised("a bad batch")
    if behaviour == "exit":
        raise SystemExit(0)
    if behaviour == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "sleep":
        time.sleep(PEER_SLEEP_S)
    if behaviour == "other":
        from tensorplay.distributed._comm import collectives

        collectives.all_reduce(torch.ones(100_000), where="something else")
        time.sleep(PEER_SLEEP_S)


def _build(front_end: str) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The model and what closes one training step after the backward (the front end's communication)."""
    import tensorplay.distributed as dist

    model = Net()
    if front_end == "fully_shard":
        from tensorplay.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif front_end == "classic":
        from tensorplay.distributed.fsdp import FullyShardedDataParallel
        from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({tp.nn.Linear}),
                                         device_id=torch.device("cpu"))
    elif front_end == "hook":
        from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = tp.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    if front_end == "zero":
        from tensorplay.distributed.optim import ZeroRedundancyOptimizer

        optim: Any = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    else:
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = None
    if front_end == "averager":
        from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        averager = PeriodicModelAverager(period=1, warmup_steps=0)

    def close_step() -> None:
        optim.step()
        if averager is not None:
            averager.average_parameters(model.parameters())  # averages what has a gradient
        optim.zero_grad()

    return model, close_step


def _layers(model: torch.nn.Module) -> Any:
    return getattr(model, "module", model).layers  # DDP and classic FSDP: .module is the Net


def train(rank: int, world: int, front_end: str, behaviour: str, started: Any) -> str:
    model, close_step = _build(front_end)
    peer = rank == world - 1
    if behaviour == "skip_load":  # the peer found no checkpoint and trains fresh; the others load one
        started.value = time.time()
        if not peer:
            model.load_state_dict(model.state_dict())

    def hook(*_args: Any) -> None:
        if peer and step == 1:
            _deviate(behaviour, started)

    _layers(model)[1].register_forward_pre_hook(hook)
    for step in range(4):
        try:
            model(torch.ones(4, 64) * (rank + step)).sum().backward()
        except PeerRaised:
            time.sleep(PEER_SLEEP_S)  # lives on
            return "peer raised and slept"
        close_step()
    return "finished"


def _rank_main(work: Callable[[int, int], Any], rank: int, world: int, port: int, env: dict[str, str],
               queue: Any) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    import tensorplay.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        outcome = ("ok", work(rank, world))
    except SystemExit:
        raise  # the peer exits through the interpreter: no report
    except BaseException as error:  # noqa: BLE001 - every error goes back
        outcome = ("raised", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}")
    queue.put((rank, *outcome, time.time()))
    queue.close()
    queue.join_thread()
    sys.exit(0)  # a normal exit: destroy and interpreter exit must not wait on a peer


def spawn_function(fn: Callable[[int], Any], world: int = 2, limit_s: float = 60.0) -> dict[int, tuple[str, str]]:
    """Run ``fn(rank)`` on ``world`` fresh ranks (the group's timeout as in the scenarios); {rank: (status, text)}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    outcome = _run(ctx, queue, functools.partial(_call_with_rank, fn), world, {}, limit_s)
    return {rank: (status, message) for rank, (status, message, _) in outcome[0].items()}


def _call_with_rank(fn: Callable[[int], Any], rank: int, world: int) -> Any:
    return fn(rank)


def spawn(front_end: str, behaviour: str, world: int = 2, env: dict[str, str] | None = None,
          limit_s: float = 60.0) -> dict[str, Any]:
    """Run one scenario; {"results": {rank: (status, message, seconds after the deviation)}, "exits": {...}}.

    ``exits`` holds each process's exit code and the seconds after the deviation it ended (None: killed, at
    ``limit_s``, or 2 s after the other ranks ended for a peer that sleeps on); ``pids`` the ranks' pids.
    """
    ctx = mp.get_context("spawn")
    queue, started = ctx.Queue(), ctx.Value("d", 0.0)
    work = functools.partial(train, front_end=front_end, behaviour=behaviour, started=started)
    raw, ended, exit_codes, pids = _run(ctx, queue, work, world, env or {}, limit_s)
    t0 = started.value
    return {"results": {rank: (status, message, at - t0) for rank, (status, message, at) in raw.items()},
            "exits": {rank: (code, ended[rank] - t0 if rank in ended else None)
                      for rank, code in enumerate(exit_codes)}, "pids": pids}


def _run(ctx: Any, queue: Any, work: Callable[[int, int], Any], world: int, env: dict[str, str],
         limit_s: float) -> tuple[dict[int, tuple[str, str, float]], dict[int, float], list[int | None], list[int]]:
    """Start the ranks, collect what they report and when each process ended; kill what is left. Returns the
    reports, the end times, the exit codes and the pids."""
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(work, r, world, port, env, queue), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    raw: dict[int, tuple[str, str, float]] = {}
    ended: dict[int, float] = {}
    deadline = time.monotonic() + limit_s
    waiting = range(world - 1)  # the peer may sleep on: done once the others ended (and 2 s more)
    while time.monotonic() < deadline and len(ended) < world:
        if all(rank in ended for rank in waiting):
            deadline = min(deadline, time.monotonic() - (time.time() - max(ended.values())) + 2.0)
        try:
            rank, status, message, at = queue.get(timeout=0.2)
            raw[rank] = (status, message, at)
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
        for rank, proc in enumerate(procs):
            if rank not in ended and not proc.is_alive():
                ended[rank] = time.time()
    while not queue.empty():
        rank, status, message, at = queue.get()
        raw[rank] = (status, message, at)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)
    return raw, ended, [proc.exitcode for proc in procs], [proc.pid for proc in procs if proc.pid is not None]
