"""Rank functions for the collective-watch tests: each run diverges (or dies) on purpose and returns what it saw.

Every rank runs in a fresh process (``spawn_ranks``): a diverged group cannot be reused.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

import tensorplay as tp
from tensorplay.testing.distributed import free_port

from tests.parity import timeout_cases

STALL_S = 2.0


class Net(tp.nn.Module):
    """Four equal layers: skipping one keeps the message sizes equal, so only the watch can tell."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = tp.nn.ModuleList(tp.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index != skip:
                x = torch.tanh(layer(x))
        return x


def _rank_main(fn: Callable[[int], Any], rank: int, world: int, port: int, queue: Any, options: dict[str, Any],
               env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import tensorplay.distributed as dist
    from tensorplay.distributed._comm import watch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=options.pop("group_timeout_s")))
    watch.configure(**options)
    start = time.monotonic()
    try:
        queue.put((rank, "ok", fn(rank), time.monotonic() - start))
    except watch.CollectiveDivergence as error:
        queue.put((rank, "raised", str(error), time.monotonic() - start))
    except BaseException:  # noqa: BLE001 - anything else goes back as a failure
        queue.put((rank, "error", traceback.format_exc(), time.monotonic() - start))
    queue.close()
    queue.join_thread()
    atexit._run_exitfuncs()  # what a normal exit runs (the watch says it exited)
    os._exit(0)  # no teardown: the group is broken on purpose


def spawn_ranks(fn: Callable[[int], Any], world: int, timeout: float = 120.0, *, group_timeout_s: float = 90.0,
                stall_s: float = STALL_S, env: dict[str, str] | None = None) -> dict[int, tuple[str, Any, float]]:
    """Run ``fn(rank)`` on ``world`` fresh Gloo ranks; {rank: (status, result or message, seconds)}.

    The group's timeout and the watch's slices are ``group_timeout_s`` and ``stall_s``; ``env`` is set in each
    rank. Ranks still running at ``timeout`` are killed and missing from the result (the test then fails: no hang).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    options = {"group_timeout_s": group_timeout_s, "stall_s": stall_s, "heartbeat_s": 0.25}
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, queue, dict(options), env or {}), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any, float]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            try:
                rank, status, payload, seconds = queue.get(timeout=0.5)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            results[rank] = (status, payload, seconds)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    return results


def _fully_shard_model() -> tuple[Net, torch.optim.Optimizer]:
    from tensorplay.distributed.fsdp import fully_shard

    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model: Net, optim: torch.optim.Optimizer, steps: int, extra: Callable[[int], None]) -> float:
    loss = torch.zeros(())
    for step in range(steps):
        extra(step)
        loss = model(torch.ones(2, 8) * step).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
    return float(loss.detach())


def extra_forward(rank: int) -> float:
    """Rank 1 runs one more forward and backward in step 1."""
    model, optim = _fully_shard_model()

    def extra(step: int) -> None:
        if rank == 1 and step == 1:
            model(torch.ones(2, 8)).sum().backward()

    return _train(model, optim, 4, extra)


def skip_group(rank: int) -> float:
    """Rank 1 skips layers.2 in step 1 (its forward and backward never gather it)."""
    model, optim = _fully_shard_model()
    for step in range(4):
        model(torch.ones(2, 8), skip=2 if rank == 1 and step == 1 else None).sum().backward()
        optim.step()
        optim.zero_grad()
    return 0.0


def no_divergence(rank: int) -> list[torch.Tensor]:
    """A healthy run: the parameters after 4 steps (and how many fingerprints were checked)."""
    model, optim = _fully_shard_model()
    _train(model, optim, 4, lambda step: None)
    return [p.full_tensor().detach() for p in model.parameters()]


def zero_skip_step(rank: int) -> float:
    """The last rank skips its ZeroRedundancyOptimizer step in step 1, then finishes (one step short)."""
    import tensorplay.distributed as dist
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    model = Net()
    optim = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for step in range(3):
        model(torch.ones(2, 8)).sum().backward()
        if not (rank == dist.get_world_size() - 1 and step == 1):
            optim.step()
        optim.zero_grad()
    return 0.0


def averager_step(rank: int) -> float:
    """Rank 1's averager has a different warm-up, so it averages at other steps than rank 0."""
    from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    model = Net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = PeriodicModelAverager(period=2, warmup_steps=1 if rank == 1 else 0)
    for step in range(4):
        model(torch.ones(2, 8) * (rank + step)).sum().backward()
        optim.step()
        averager.average_parameters(model.parameters())
    return 0.0


def killed_mid_step(rank: int) -> float:
    """Rank 2 kills itself (SIGKILL) in the middle of step 2's forward."""
    model, optim = _fully_shard_model()

    def die(*_args: Any) -> None:
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    def extra(step: int) -> None:
        if step == 2:
            model.layers[1].register_forward_pre_hook(die)

    return _train(model, optim, 5, extra)


def stopped_mid_step(rank: int) -> float:
    """Rank 1 stops itself (SIGSTOP) in step 2's forward; rank 0 lets it go on (SIGCONT) once it has raised."""
    import tensorplay.distributed as dist

    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    model, optim = _fully_shard_model()
    stopped: list[bool] = []

    def stop(*_args: Any) -> None:
        if rank == 1 and not stopped:
            stopped.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def extra(step: int) -> None:
        if step == 2:
            model.layers[1].register_forward_pre_hook(stop)

    try:
        return _train(model, optim, 4, extra)
    finally:
        if rank == 0:
            os.kill(pids[1], signal.SIGCONT)


def wide() -> tp.nn.Module:
    """Two layers of 100 KiB each: ZeRO's broadcasts go through shared memory, DDP's all-reduce through Gloo."""
    return timeout_cases.Net(width=160, depth=2)


QUICK_STALL_S = 0.5  # the watch's slices in the ZeRO-under-DDP cases' tests
COMPUTE_SLICES = 6  # how many of the slices the computing peer computes for (the idle rule needs 1-2)


def _zero_under_ddp(rank: int, before_step: Callable[[int], bool]) -> float:
    """ZeRO over a DDP model, three steps; a step's ZeRO step runs when ``before_step(step)`` (called after its
    backward) says so. Returns the sum of the parameters."""
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    model = tp.nn.parallel.DistributedDataParallel(wide())
    optim = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for step in range(3):
        model(torch.ones(2, 160) * (rank + 1)).sum().backward()
        if before_step(step):
            optim.step()
        optim.zero_grad()
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def zero_under_ddp_skip_step(rank: int) -> float:
    """Under DDP, rank 1 skips its ZeRO step in step 1: it waits in DDP's own all-reduce of step 2 (not ours)
    while rank 0 waits for it in ZeRO's broadcast."""
    return _zero_under_ddp(rank, lambda step: not (rank == 1 and step == 1))


def zero_under_ddp_peer_computes(rank: int) -> float:
    """Under DDP, rank 1 computes (a busy main thread) for COMPUTE_SLICES of the watch's slices before its ZeRO
    step in step 1."""
    from tensorplay.distributed._comm import watch

    def compute(step: int) -> bool:
        if rank == 1 and step == 1:
            end, total = time.monotonic() + COMPUTE_SLICES * watch.configure().stall_s, 0  # the options as they are
            while time.monotonic() < end:
                total += sum(range(1000))
        return True

    return _zero_under_ddp(rank, compute)
