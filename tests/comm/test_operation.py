"""Operating the communication layer: the shared-memory switch, the fallback log lines, nothing left in /dev/shm."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives, host_memory
from tensorplay.distributed._comm.host_files import made_by
from tensorplay.testing.distributed import run_distributed

from tests.parity import timeout_cases as cases


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _train_classic(group: dist.ProcessGroup) -> list[torch.Tensor]:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 8)),
                                     process_group=group, device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        inputs = torch.randn(4, 300, generator=torch.Generator().manual_seed(dist.get_rank() * 10 + step))
        model(inputs).sum().backward()
        optim.step()
        optim.zero_grad()
    with FullyShardedDataParallel.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _collectives(group: dist.ProcessGroup) -> list[torch.Tensor]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    values = torch.randn(world * 40_000, generator=torch.Generator().manual_seed(rank))
    gathered = torch.empty(world * values.numel())
    collectives.all_gather_flat(gathered, values, group)
    scattered = torch.empty(40_000)
    collectives.reduce_scatter_flat(scattered, values.clone(), group)
    summed = values.clone()
    collectives.all_reduce(summed, group)
    sent = values.clone()
    collectives.broadcast(sent, 1, group)
    return [gathered, scattered, summed, sent]


def _native(group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The same four collectives through Gloo's own calls: the oracle for both transports."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    values = torch.randn(world * 40_000, generator=torch.Generator().manual_seed(rank))
    gathered = torch.empty(world * values.numel())
    dist.all_gather_into_tensor(gathered, values, group=group)
    scattered = torch.empty(40_000)
    dist.reduce_scatter_tensor(scattered, values.clone(), group=group)
    summed = values.clone()
    dist.all_reduce(summed, group=group)
    sent = values.clone()
    dist.broadcast(sent, group=group, group_src=1)
    return [gathered, scattered, summed, sent]


def switched_off_and_on() -> dict[str, object]:
    handler = _Lines()
    logger = logging.getLogger("tensorplay.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        host_memory.set_shared_memory(False)
        off = dist.new_group(list(range(dist.get_world_size())))
        off_results = _collectives(off) + _train_classic(off)
        host_memory.set_shared_memory(None)  # the environment decides again: on
        on = dist.new_group(list(range(dist.get_world_size())))
        on_results = _collectives(on) + _train_classic(on)
        full = dist.new_group(list(range(dist.get_world_size())))
        with mock.patch.object(host_memory, "_reserve", return_value=""):  # /dev/shm has no room
            _collectives(full)
            _collectives(full)
    finally:
        logger.removeHandler(handler)
        host_memory.set_shared_memory(None)
    native = _native(dist.new_group(list(range(dist.get_world_size()))))
    return {"equal": [torch.equal(a, b) for a, b in zip(off_results, on_results, strict=True)],
            "native": [torch.equal(a, b) and torch.equal(c, b)
                       for a, c, b in zip(off_results[:4], on_results[:4], native, strict=True)],
            "arenas": (host_memory.arena_for(off), host_memory.arena_for(on) is not None),
            "names": (off.group_name, full.group_name), "lines": handler.lines}


def test_shared_memory_off_is_bitwise_the_same_and_each_fallback_says_so_once():
    for result in run_distributed(switched_off_and_on, world_size=2):
        assert all(result["native"]), result["native"]  # off and on: bitwise Gloo's own calls
        assert all(result["equal"]), result["equal"]  # and classic FSDP trains bitwise alike either way
        assert result["arenas"] == (None, True)
        off_name, full_name = result["names"]
        switched = [line for line in result["lines"] if f"'{off_name}'" in line[1]]
        assert switched == [("INFO", f"process group '{off_name}' (global ranks [0, 1]): shared memory is switched "
                                     "off (TENSORPLAY_SHM=0 or set_shared_memory(False)); its collectives use Gloo's "
                                     "own calls and their compositions instead of shared memory")], result["lines"]
        full = [line for line in result["lines"] if f"'{full_name}'" in line[1]]
        assert len(full) == 1 and full[0][0] == "WARNING" and "could not be mapped from /dev/shm" in full[0][1], full


def _pids(out: str) -> list[int]:
    """The pids the ranks wrote to ``out`` (:func:`_say_pid`)."""
    return [int(path.read_text()) for path in sorted(Path(out).glob("*.pid"))]


def _say_pid(out: str, rank: int) -> None:
    (Path(out) / f"{rank}.pid").write_text(str(os.getpid()))


@pytest.mark.parametrize("behaviour", ["exit", "kill"])
def test_nothing_is_left_in_dev_shm_after_any_exit(behaviour):
    outcome = cases.spawn("fully_shard", behaviour)
    assert outcome["results"][0][0] == "raised", outcome
    assert len(outcome["pids"]) == 2 and made_by(outcome["pids"]) == []  # only this job's files count


def kill_during_set_up(out: str, rank: int) -> None:
    """Rank 1 dies right after opening its peers' pipes, before the directory is removed."""
    from tensorplay.distributed._comm import host_barrier

    _say_pid(out, rank)
    opened = host_barrier._open_peers

    def open_then_die(*args: object) -> object:
        peers = opened(*args)
        if rank == 1:
            os.kill(os.getpid(), 9)
        return peers

    host_barrier._open_peers = open_then_die
    collectives.all_reduce(torch.ones(100_000))


def test_nothing_is_left_in_dev_shm_when_a_rank_is_killed_during_set_up(tmp_path):
    results = cases.spawn_function(functools.partial(kill_during_set_up, str(tmp_path)))
    assert results[0][0] == "raised", results
    pids = _pids(str(tmp_path))
    assert len(pids) == 2 and made_by(pids) == []


def die_as_the_name_is_sent(out: str, rank: int) -> None:
    """Rank 1 dies as rank 0 sends it the name of the pipes' directory (made by rank 0; no other rank knows it)."""
    from tensorplay.distributed._comm import host_barrier

    _say_pid(out, rank)
    if rank == 1:
        host_barrier.path_from_rank0 = lambda *args: os.kill(os.getpid(), 9)  # type: ignore[assignment]
    collectives.all_reduce(torch.ones(100_000))


def test_nothing_is_left_in_dev_shm_when_the_name_never_reaches_a_peer(tmp_path):
    results = cases.spawn_function(functools.partial(die_as_the_name_is_sent, str(tmp_path)))
    assert results[0][0] == "raised", results
    pids = _pids(str(tmp_path))
    assert len(pids) == 2 and made_by(pids) == []


def _entries_into_comm(fn: object) -> list[str]:
    """The calls ``fn()`` makes from outside the communication package into it, in order (its way in)."""
    import sys

    package = os.sep + "_comm" + os.sep
    entries: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        code, caller = frame.f_code, frame.f_back  # type: ignore[attr-defined]
        if event == "call" and package in code.co_filename and caller is not None \
                and package not in caller.f_code.co_filename:
            entries.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")

    sys.setprofile(profile)
    try:
        fn()  # type: ignore[operator]
    finally:
        sys.setprofile(None)
    return entries


def ways_into_the_transport() -> dict[str, list[str]]:
    """One DDP hook all-reduce and one fully_shard training step, traced at the package boundary."""
    from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from tensorplay.distributed.fsdp import fully_shard

    class Bucket:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def buffer(self) -> torch.Tensor:
            return self.tensor

    allreduce_hook(dist.group.WORLD, Bucket(torch.ones(1 << 16))).wait()  # set-up (the arena) outside the trace
    hook = _entries_into_comm(lambda: allreduce_hook(dist.group.WORLD, Bucket(torch.ones(1 << 16))).wait())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8))
    fully_shard(model)
    model(torch.ones(2, 8)).sum().backward()  # lazy init and plan agreement outside the trace
    step = _entries_into_comm(lambda: model(torch.ones(2, 8)).sum().backward())
    return {"hook": hook, "fully_shard step": step}


def test_one_all_reduce_enters_the_transport_once():
    """The DDP hook's all-reduce enters the communication package once (and its future is the one way out);
    a fully_shard step enters it only through the collective API (one all-gather, one reduce-scatter), with
    the handle's wait as the way out: the front end never asks which transport runs."""
    for traced in run_distributed(ways_into_the_transport, world_size=2):
        assert traced["hook"] == ["collectives.py:all_reduce_future"], traced["hook"]
        calls = [entry for entry in traced["fully_shard step"] if not entry.endswith((":wait", ":then"))]
        assert calls == ["collectives.py:all_gather_flat", "collectives.py:reduce_scatter_flat"], calls
