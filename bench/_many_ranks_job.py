"""One rank of ``bench_many_ranks.py``: launched by ``tprun``, times set-up and steps of fully_shard and ZeRO.

Each rank: init Gloo, then a tiny model with our fully_shard (default group), PyTorch's fully_shard,
``DistributedDataParallel`` + our ``ZeroRedundancyOptimizer`` and the same with PyTorch's (each in a new
group of all ranks, so it pays its own set-up); for each, construction, step 1, then ``--steps`` more
steps (CPU of forward + backward and of the optimizer step apart), and the same model's local step
(no process group) as the reference. The parts of our set-up that could grow with the world size are
timed by wrapping them: the shared-memory arena (``_comm/host_memory.arena_for``, first call per group,
which includes the pipe barrier), the pipe barrier alone (``_comm/host_barrier.open_pipe_barrier``),
the slot mapping (``HostArena._map``) and the plan agreement (``_checks/plan_agreement.check_plan_agreement``
as fully_shard and ZeRO call it). Writes ``rank<r>.json`` into ``$TP_MANY_RANKS_OUT``; times are seconds,
wall clock (``time.perf_counter``) and this process's CPU (``time.process_time``, all its threads).
``$TP_MANY_RANKS_LAUNCH`` is the launcher's start (``time.time()``).
"""

from __future__ import annotations

import os
import time

LAUNCH = float(os.environ.get("TP_MANY_RANKS_LAUNCH", time.time()))
START = time.time()

import argparse  # noqa: E402  (after the start time: the imports are part of the start-up)
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  (DTensor.from_local imports it on first use, ~2 s: here, not in a build)
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp as torch_fsdp  # noqa: E402  (the baselines: imported here, not in their timed builds)
import torch.distributed.optim as torch_optim  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import tensorplay.distributed.fsdp._fully_shard._fsdp_plan_agreement as fsdp_agreement  # noqa: E402
import tensorplay.distributed.optim.zero._optimizer as zero_module  # noqa: E402
from tensorplay.distributed._comm import collectives, host_memory  # noqa: E402
from tensorplay.distributed.fsdp import fully_shard  # noqa: E402
from tensorplay.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402

IMPORTED = time.time()
WIDTH, DEPTH, BATCH = 64, 4, 8

# (wall s, cpu s, calls) per timed part of our set-up; one process is one rank here, so module state is fine
SPENT: dict[str, list[float]] = {}


def _timed(owner: Any, name: str, part: str, first_only: Callable[..., bool] | None = None) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall and CPU time to ``SPENT[part]``."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if first_only is not None and not first_only(*args):
            return inner(*args, **kwargs)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent = SPENT.setdefault(part, [0.0, 0.0, 0])
            spent[0] += time.perf_counter() - wall
            spent[1] += time.process_time() - cpu
            spent[2] += 1

    setattr(owner, name, wrapper)


def install_timers() -> None:
    _timed(collectives, "arena_for", "shm arena set-up", lambda group, *_: group not in host_memory._ARENAS)
    _timed(host_memory, "open_pipe_barrier", "pipe barrier set-up")
    _timed(host_memory.HostArena, "_map", "shm slot mapping")
    _timed(fsdp_agreement, "check_plan_agreement", "plan agreement")
    _timed(zero_module, "check_plan_agreement", "plan agreement")


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def stepper(net: torch.nn.Module, optim: torch.optim.Optimizer, rank: int,
            phases: dict[str, float] | None = None) -> Callable[[], None]:
    """One training step; with ``phases``, add the CPU seconds of forward + backward and of the optimizer step."""
    batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        start = time.process_time()
        net(batch).sum().backward()
        middle = time.process_time()
        optim.step()
        optim.zero_grad()
        if phases is not None:
            phases["backward"] = phases.get("backward", 0.0) + middle - start
            phases["optimizer"] = phases.get("optimizer", 0.0) + time.process_time() - middle

    return step


def build_fully_shard(group: Any, impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    shard = fully_shard if impl == "ours" else torch_fsdp.fully_shard
    net, mesh = model(), DeviceMesh.from_group(group, "cpu")
    for layer in net:
        shard(layer, mesh=mesh)
    shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def build_zero(group: Any, impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    zero = ZeroRedundancyOptimizer if impl == "ours" else torch_optim.ZeroRedundancyOptimizer
    net = DistributedDataParallel(model(), process_group=group)
    return net, zero(net.parameters(), torch.optim.Adam, process_group=group, lr=1e-3)


# (result key, builder, implementation); each front end in a group of its own, ours before PyTorch's
FRONT_ENDS = (("fully_shard", build_fully_shard, "ours"), ("fully_shard_torch", build_fully_shard, "torch"),
              ("zero", build_zero, "ours"), ("zero_torch", build_zero, "torch"))


def per_step(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``steps`` steps, each started after a barrier of all ranks."""
    walls, cpus = [], []
    for _ in range(steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return sorted(walls)[steps // 2], sorted(cpus)[steps // 2]


def run_front_end(build: Callable[[Any, str], tuple[torch.nn.Module, torch.optim.Optimizer]], impl: str,
                  group: Any, rank: int, steps: int) -> dict[str, Any]:
    SPENT.clear()
    dist.barrier()
    begin, cpu = time.perf_counter(), time.process_time()
    net, optim = build(group, impl)
    built = time.perf_counter()
    stepper(net, optim, rank)()
    first = time.perf_counter()
    setup = {part: list(spent) for part, spent in SPENT.items()}
    phases: dict[str, float] = {}
    wall, step_cpu = per_step(stepper(net, optim, rank, phases), steps)
    local_net = model()
    local_wall, local_cpu = per_step(stepper(local_net, torch.optim.Adam(local_net.parameters(), lr=1e-3), rank),
                                     steps)
    return {"construct_s": built - begin, "first_step_s": first - built,
            "setup_cpu_s": time.process_time() - cpu, "first_step_end": time.time(), "parts": setup,
            "step_s": wall, "step_cpu_s": step_cpu, "local_step_s": local_wall, "local_step_cpu_s": local_cpu,
            **{f"{phase}_cpu_s": total / steps for phase, total in phases.items()}}


def memory_mib() -> tuple[float, float]:
    """This process's resident and private memory in MiB (Linux ``/proc``)."""
    values = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, amount = line.split(":", 1)
        values[key] = int(amount.split()[0])
    return values["Rss"] / 1024, (values["Private_Clean"] + values["Private_Dirty"]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    install_timers()
    init = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank, "world": world, "start_s": START - LAUNCH, "import_s": IMPORTED - START,
                              "init_s": time.perf_counter() - init}
    for key, build, impl in FRONT_ENDS:
        group = dist.group.WORLD if key == "fully_shard" else dist.new_group(list(range(world)))
        result[key] = run_front_end(build, impl, group, rank, args.steps)
    result["first_step_from_launch_s"] = result["fully_shard"]["first_step_end"] - LAUNCH
    result["rss_mib"], result["private_mib"] = memory_mib()
    Path(os.environ["TP_MANY_RANKS_OUT"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
