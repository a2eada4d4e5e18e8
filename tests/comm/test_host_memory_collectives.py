"""Shared-memory collectives (``_comm/host_memory.py``): bitwise Gloo's native ones at every world size."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives, host_barrier, host_memory
from tensorplay.distributed._comm.host_files import made_by
from tensorplay.testing.distributed import free_port, run_distributed


def _group_files() -> list[str]:
    """What the ranks of this job made in /dev/shm and left there (other jobs' files do not count)."""
    pids: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return made_by(pid for pid in pids if pid is not None)


def _mixed(numel: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values of mixed magnitude: where the order of a sum would show."""
    scale = 10.0 ** torch.randint(-3, 4, (numel,), generator=generator)
    return (torch.randn(numel, generator=generator) * scale).to(dtype)


def _with_plan(all_gather: str, reduce_scatter: str):
    saved = collectives.PLANS["gloo"]
    collectives.set_collective_plan("gloo", all_gather=all_gather, reduce_scatter=reduce_scatter)  # type: ignore[arg-type]
    return saved


def shared_against_native() -> dict[str, bool]:
    """Growing sizes, several dtypes, three operations in flight and waited in reverse: every result is native's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    same: dict[str, bool] = {}
    saved = _with_plan("shared_memory", "shared_memory")
    arena = host_memory.arena_for(torch.distributed.distributed_c10d._get_default_group())
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for numel in (1, 7, 1000, 65537):
                shard = _mixed(numel, generator, dtype)
                native = torch.empty(world * numel, dtype=dtype)
                torch.distributed.all_gather_into_tensor(native, shard)
                ours = torch.empty_like(native)
                collectives.all_gather_flat(ours, shard, async_op=True).wait()
                same[f"all-gather {dtype} {numel}"] = torch.equal(native, ours)
                full = _mixed(world * numel, generator, dtype)
                expected = torch.empty(numel, dtype=dtype)
                torch.distributed.reduce_scatter_tensor(expected, full.clone())
                reduced = torch.empty(numel, dtype=dtype)
                collectives.reduce_scatter_flat(reduced, full.clone())
                same[f"reduce-scatter {dtype} {numel}"] = torch.equal(reduced, expected)
        numel = 1 + 3 * 1024 * 1024 // world  # more than two 1 MiB segments per rank in Gloo's ring
        full = _mixed(world * numel, generator)
        expected = torch.empty(numel)
        torch.distributed.reduce_scatter_tensor(expected, full.clone())
        reduced = torch.empty(numel)
        collectives.reduce_scatter_flat(reduced, full.clone(), async_op=True).wait()
        same[f"reduce-scatter {numel} in 1 MiB segments"] = torch.equal(reduced, expected)
        inside = full.clone()  # in pieces (rows past PIECE_ROWS_BYTES), the output inside the input
        own = inside.view(world, numel)[rank]
        collectives.reduce_scatter_flat(own, inside, async_op=True).wait()
        same["reduce-scatter in pieces into its own chunk"] = torch.equal(own, expected)
        shard = _mixed(numel, generator)
        native = torch.empty(world * numel)
        torch.distributed.all_gather_into_tensor(native, shard)
        ours = torch.empty_like(native)
        collectives.all_gather_flat(ours, shard)
        same["all-gather in pieces"] = torch.equal(native, ours)
        shards = [_mixed(333, generator) for _ in range(3)]
        outputs = [torch.empty(world * 333) for _ in shards]
        pendings = [collectives.all_gather_flat(out, shard, async_op=True)
                    for out, shard in zip(outputs, shards, strict=True)]
        for pending in reversed(pendings):
            pending.wait()
        for i, (out, shard) in enumerate(zip(outputs, shards, strict=True)):
            native = torch.empty_like(out)
            torch.distributed.all_gather_into_tensor(native, shard)
            same[f"in flight {i}"] = torch.equal(native, out)
        same["slots no larger than a piece"] = arena is not None and arena._slot_bytes <= host_memory.PIECE_ROWS_BYTES
    finally:
        collectives.PLANS["gloo"] = saved
    return same


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_memory_collectives_match_native(world_size):
    for result in run_distributed(shared_against_native, world_size=world_size):
        assert all(result.values()), [name for name, ok in result.items() if not ok]


def default_plan_reduces_through_shared_memory() -> bool:
    """The default Gloo plan reduces through shared memory with the pipe barrier, bitwise the native reduce-scatter.

    Neither the slots' file nor the pipes' directory is left in /dev/shm.
    """
    generator = torch.Generator().manual_seed(dist.get_rank())
    full = _mixed(dist.get_world_size() * 4099, generator)
    native = torch.empty(4099)
    torch.distributed.reduce_scatter_tensor(native, full.clone())
    ours = torch.empty(4099)
    collectives.reduce_scatter_flat(ours, full.clone(), async_op=True).wait()
    arena = host_memory.arena_for(torch.distributed.distributed_c10d._get_default_group())
    leftovers = _group_files()
    return arena is not None and arena._pipes is not None and torch.equal(native, ours) and not leftovers


@pytest.mark.parametrize("world_size", [2, 4])
def test_default_reduce_scatter_goes_through_shared_memory_bitwise(world_size):
    assert run_distributed(default_plan_reduces_through_shared_memory, world_size=world_size) == [True] * world_size


def slots_are_reported_with_their_ranks() -> bool:
    """``mapped_slots`` lists a group's slot file (its size, the ranks mapping it) once it is mapped, not before."""
    group = dist.new_group(list(range(dist.get_world_size())))
    before = host_memory.mapped_slots()
    shard = torch.ones(64 * 1024)
    collectives.all_gather_flat(torch.empty(dist.get_world_size() * shard.numel()), shard, group)
    arena = host_memory.arena_for(group)
    assert arena is not None and arena._slots is not None
    entry = (arena._slots.nbytes, dist.get_world_size())
    return host_memory.mapped_slots().count(entry) == before.count(entry) + 1  # other groups' may be alike


@pytest.mark.parametrize("world_size", [2, 4])
def test_mapped_slots_names_each_file_and_its_ranks(world_size):
    assert run_distributed(slots_are_reported_with_their_ranks, world_size=world_size) == [True] * world_size


def ranks_on_different_hosts() -> tuple[bool, bool, list[str]]:
    """Ranks that say they are on different hosts get no arena, and the Gloo compositions instead."""
    group = dist.new_group(list(range(dist.get_world_size())))  # a fresh group: its host check is still to come
    rank = dist.get_rank()
    real = host_memory._host_id
    host_memory._host_id = lambda: 1000 + rank  # type: ignore[assignment]
    try:
        shard = torch.arange(4.0) + 10 * rank
        gathered = torch.empty(8)
        collectives.all_gather_flat(gathered, shard, group)
    finally:
        host_memory._host_id = real  # type: ignore[assignment]
    leftovers = _group_files()
    expected = torch.cat([torch.arange(4.0), torch.arange(4.0) + 10])
    return host_memory.arena_for(group) is None, torch.equal(gathered, expected), leftovers


def test_ranks_on_different_hosts_fall_back_to_gloo():
    for no_arena, gathered, leftovers in run_distributed(ranks_on_different_hosts):
        assert no_arena and gathered
        assert leftovers == [], "a shared-memory file outlived its mapping"


def no_room_in_dev_shm() -> tuple[bool, bool, bool]:
    """/dev/shm without room for the slots (rank 0 cannot reserve them): every rank takes Gloo, results unchanged."""
    group = dist.new_group(list(range(dist.get_world_size())))
    real = host_memory._reserve
    host_memory._reserve = lambda nbytes: ""  # type: ignore[assignment]
    try:
        rank = dist.get_rank()
        gathered = torch.empty(8)
        collectives.all_gather_flat(gathered, torch.arange(4.0) + 10 * rank, group)
        reduced = torch.empty(4)
        collectives.reduce_scatter_flat(reduced, torch.arange(8.0) * (rank + 1), group, async_op=True).wait()
    finally:
        host_memory._reserve = real  # type: ignore[assignment]
    arena = host_memory.arena_for(group)
    expected_gather = torch.cat([torch.arange(4.0), torch.arange(4.0) + 10])
    expected_reduce = torch.arange(8.0).view(2, 4)[rank] * 3
    return (arena is not None and arena._full, torch.equal(gathered, expected_gather),
            torch.equal(reduced, expected_reduce))


def test_no_room_in_dev_shm_falls_back_to_gloo_on_every_rank():
    assert run_distributed(no_room_in_dev_shm) == [(True, True, True)] * 2


def all_reduce_against_native() -> dict[str, bool]:
    """Shared-memory all-reduces from 64 KiB are bitwise Gloo's; those past the rows' cap too, in even pieces."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    arena = host_memory.arena_for(torch.distributed.distributed_c10d._get_default_group())
    issued_before = arena._issued if arena is not None else -1
    same = {}
    for dtype, numel in [(torch.float32, 16385), (torch.bfloat16, 40001), (torch.float32, 500001)]:
        values = _mixed(numel, generator, dtype)
        native = values.clone()
        torch.distributed.all_reduce(native)
        ours = values.clone()
        pending = collectives.all_reduce(ours, async_op=True)
        same[f"{dtype} {numel}"] = torch.equal(native, ours) if pending.wait() is None else False
    world = dist.get_world_size()
    pieces = (500001 * 4 * world - 1) // host_memory.PIECE_ROWS_BYTES + 1
    same["through shared memory"] = arena is not None and arena._issued - issued_before == 2 + pieces
    issued_before = arena._issued if arena is not None else -1
    large = _mixed(3 * 1024 * 1024 + 5, generator)  # pieces of rows past the cap, across Gloo's 1 MiB segments
    native = large.clone()
    torch.distributed.all_reduce(native)
    collectives.all_reduce(large, async_op=True).wait()
    pieces = (large.numel() * 4 * world - 1) // host_memory.PIECE_ROWS_BYTES + 1
    same["larger rows in pieces"] = torch.equal(native, large) and arena._issued - issued_before == pieces
    return same


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_memory_all_reduce_matches_native(world_size):
    for result in run_distributed(all_reduce_against_native, world_size=world_size):
        assert all(result.values()), [name for name, ok in result.items() if not ok]


def discarded_result_is_never_written() -> tuple[bool, bool]:
    """A discarded shared-memory all-gather leaves its output alone, even once the next operation reuses slots."""
    rank = dist.get_rank()
    untouched = torch.full((8,), -1.0)
    collectives.all_gather_flat(untouched, torch.arange(4.0) + rank, async_op=True).discard()
    gathered = torch.empty(8)
    collectives.all_gather_flat(gathered, torch.arange(4.0) + rank, async_op=True).wait()
    collectives.all_gather_flat(torch.empty(8), torch.arange(4.0), async_op=True).wait()
    expected = torch.tensor([0.0, 1, 2, 3, 1, 2, 3, 4])
    return torch.equal(untouched, torch.full((8,), -1.0)), torch.equal(gathered, expected)


def test_discarded_result_is_never_written():
    assert run_distributed(discarded_result_is_never_written) == [(True, True)] * 2


def _gather_with_rank_1_failing(module: object, name: str,
                                failing: object) -> tuple[host_memory.HostArena | None, bool]:
    """A fresh group's first all-gather, ``module.name`` replaced by ``failing`` on rank 1: its arena, and
    whether the gathered values are right."""
    group = dist.new_group(list(range(dist.get_world_size())))
    rank = dist.get_rank()
    real = getattr(module, name)
    if rank == 1:
        setattr(module, name, failing)
    try:
        gathered = torch.empty(8)
        collectives.all_gather_flat(gathered, torch.arange(4.0) + 10 * rank, group)
    finally:
        setattr(module, name, real)
    expected = torch.cat([torch.arange(4.0), torch.arange(4.0) + 10])
    return host_memory.arena_for(group), torch.equal(gathered, expected)


def one_rank_cannot_map_the_file() -> tuple[bool, bool]:
    """A rank that cannot map rank 0's file (another /dev/shm behind the same host name): every rank takes Gloo."""
    arena, gathered = _gather_with_rank_1_failing(host_memory, "_map_shared", lambda path, nbytes: None)
    return arena is not None and arena._full, gathered


def test_a_rank_that_cannot_map_the_file_makes_every_rank_fall_back():
    assert run_distributed(one_rank_cannot_map_the_file) == [(True, True)] * 2


def one_rank_cannot_make_its_pipe() -> tuple[bool, bool, bool]:
    """A rank that cannot make its FIFO: every rank takes the Gloo barrier instead, results unchanged."""
    arena, gathered = _gather_with_rank_1_failing(host_barrier, "_make_own_fifo", lambda directory, rank: None)
    leftovers = _group_files()
    return arena is not None and arena._pipes is None, gathered, not leftovers


def test_a_rank_that_cannot_make_its_pipe_makes_every_rank_use_the_gloo_barrier():
    assert run_distributed(one_rank_cannot_make_its_pipe) == [(True, True, True)] * 2


def broadcast_against_native() -> dict[str, bool]:
    """Broadcasts from every rank, past 64 KiB through shared memory (in pieces past the slots): native's bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    arena = host_memory.arena_for(torch.distributed.distributed_c10d._get_default_group())
    issued_before = arena._issued if arena is not None else -1
    same = {}
    for numel in (100, 40000, 2 * 1024 * 1024 + 3):
        for src in range(world):
            values = _mixed(numel, generator)
            native = values.clone()
            torch.distributed.broadcast(native, src)
            ours = values.clone()
            pending = collectives.broadcast(ours, src, async_op=True)
            same[f"{numel} from {src}"] = torch.equal(native, ours) if pending.wait() is None else False
    pieces = (2 * 1024 * 1024 + 3) * 4 // host_memory.PIECE_ROWS_BYTES + 1
    same["through shared memory"] = arena is not None and arena._issued - issued_before == world * (1 + pieces)
    return same


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_memory_broadcast_matches_native(world_size):
    for result in run_distributed(broadcast_against_native, world_size=world_size):
        assert all(result.values()), [name for name, ok in result.items() if not ok]


def gather_parts_against_native() -> dict[str, bool]:
    """An all-gather into separate destinations (GatherParts) holds exactly PyTorch's all-gathered columns.

    Every all-gather algorithm (shared memory: straight from the slot, in pieces past the rows' cap; the
    others through a buffer), parts that straddle piece bounds, columns no part takes (padding), and
    destinations whose version counters must not move (they are parameters' memory).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    same: dict[str, bool] = {}
    saved = collectives.PLANS["gloo"]
    try:
        for algo in ("shared_memory", "native", "broadcast"):
            collectives.set_collective_plan("gloo", all_gather=algo)  # type: ignore[arg-type]
            for numel in (10, 3 * 1024 * 1024 // world + 5):  # the second goes in several pieces
                shard = _mixed(numel, generator)
                native = torch.empty(world * numel)
                torch.distributed.all_gather_into_tensor(native, shard)
                spans = [(0, numel // 3), (numel // 3, numel // 2), (numel // 2 + 2, numel - numel // 2 - 3)]
                destinations = [torch.full((world, n), float("nan")) for _, n in spans]
                versions = [d._version for d in destinations]
                parts = collectives.GatherParts([(o, d) for (o, _), d in zip(spans, destinations, strict=True)])
                collectives.all_gather_flat(parts, shard, async_op=True).wait()
                columns = native.view(world, numel)
                same[f"{algo} {numel}"] = all(torch.equal(d, columns[:, o:o + n]) for (o, n), d
                                              in zip(spans, destinations, strict=True))
                same[f"{algo} {numel} versions"] = [d._version for d in destinations] == versions
    finally:
        collectives.PLANS["gloo"] = saved
    return same


def gather_parts_without_room() -> bool:
    """GatherParts where /dev/shm has no room: the Gloo composition through a buffer, same columns."""
    group = dist.new_group(list(range(dist.get_world_size())))
    real = host_memory._reserve
    host_memory._reserve = lambda nbytes: ""  # type: ignore[assignment]
    try:
        destination = torch.empty(2, 3)
        collectives.all_gather_flat(collectives.GatherParts([(1, destination)]),
                                    torch.arange(4.0) + 10 * dist.get_rank(), group)
    finally:
        host_memory._reserve = real  # type: ignore[assignment]
    return torch.equal(destination, torch.tensor([[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]]))


def test_gather_parts_without_room_in_dev_shm_fall_back_to_gloo():
    assert run_distributed(gather_parts_without_room) == [True, True]


def input_overwritten_after_issue() -> bool:
    """A shared-memory reduce-scatter has staged its whole input when it returns (fully_shard frees the gradients
    then): overwriting the input before waiting changes nothing (bitwise Gloo's), also in several pieces."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    saved = _with_plan("shared_memory", "shared_memory")
    try:
        numel = 3 * 1024 * 1024 // world + 7
        full = _mixed(world * numel, generator)
        expected = torch.empty(numel)
        torch.distributed.reduce_scatter_tensor(expected, full.clone())
        reduced = torch.empty(numel)
        pending = collectives.reduce_scatter_flat(reduced, full, async_op=True)
        full.fill_(float("nan"))  # the caller reuses its input at once
        pending.wait()
    finally:
        collectives.PLANS["gloo"] = saved
    return torch.equal(reduced, expected)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_memory_reduce_scatter_consumes_its_input_on_issue(world_size):
    assert run_distributed(input_overwritten_after_issue, world_size=world_size) == [True] * world_size


def _reduce_scatter_of_parts_against_native(case) -> dict[str, bool]:  # noqa: ANN001 (a case function)
    """Under every reduce-scatter path, ``case(columns, world, generator)`` gives parts and the buffer they stand
    for: the reduce-scatter of the parts must be bitwise PyTorch's reduce-scatter of the buffer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    same: dict[str, bool] = {}
    saved = collectives.PLANS["gloo"]
    try:
        for algo in ("shared_memory", "native", "composed", "all_reduce"):
            collectives.set_collective_plan("gloo", reduce_scatter=algo)  # type: ignore[arg-type]
            for columns in (12, 3 * 1024 * 1024 // world + 9):
                parts, full = case(columns, world, generator)
                expected = torch.empty(columns)
                torch.distributed.reduce_scatter_tensor(expected, full)
                reduced = torch.full((columns,), float("nan"))
                collectives.reduce_scatter_flat(reduced, parts, async_op=True).wait()
                same[f"{algo} {columns}"] = torch.equal(reduced, expected)
    finally:
        collectives.PLANS["gloo"] = saved
    return same


def _scatter_parts(columns: int, world: int, generator: torch.Generator):  # noqa: ANN202
    """Sources of other strides (a transposed view), another dtype (cast on staging) and an expanded one."""
    a = columns // 2
    b = columns - a - 2
    sources = [_mixed(a * world, generator).view(a, world).t(),  # (world, a), strided
               _mixed(world * b, generator, torch.float64).view(world, b),  # cast on staging
               torch.full((1, 2), 0.5).expand(world, 2)]  # no memory
    parts = collectives.ScatterParts([(0, sources[0]), (a, sources[1]), (a + b, sources[2])], columns, torch.float32)
    return parts, torch.cat([s.to(torch.float32) for s in sources], dim=1).reshape(-1)


def _flat_parts(columns: int, world: int, generator: torch.Generator):  # noqa: ANN202
    """A gap at the start, a piece across chunk boundaries, a gap, a piece, zeros to the end; the large case
    divided on the way in (the buffer: divided in place)."""
    total, divide = world * columns, 2.0 if columns > 12 else 1.0
    bounds = [(3, total // 2 + 2), (total // 2 + 4, total - 3)]
    pieces = [(start, _mixed(stop - start, generator)) for start, stop in bounds]
    full = torch.zeros(total)
    for start, source in pieces:
        full[start:start + source.numel()] = source
    return collectives.FlatParts(pieces, columns, torch.float32, torch.device("cpu"), divide), full.div_(divide)


def scatter_parts_against_native() -> dict[str, bool]:
    """A reduce-scatter of separate sources (ScatterParts) is bitwise PyTorch's reduce-scatter of their buffer:
    shared memory straight from the sources, in pieces; the other paths through a buffer."""
    return _reduce_scatter_of_parts_against_native(_scatter_parts)


def flat_parts_against_native() -> dict[str, bool]:
    """Pieces at offsets (FlatParts: the gaps zero, divided on the way in): bitwise the same as their buffer."""
    return _reduce_scatter_of_parts_against_native(_flat_parts)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("check", [gather_parts_against_native, scatter_parts_against_native,
                                   flat_parts_against_native],
                         ids=["all-gather into parts", "reduce-scatter of parts", "reduce-scatter of flat parts"])
def test_collectives_of_parts_match_native(check, world_size):
    for same in run_distributed(check, world_size=world_size):
        assert same and all(same.values()), [name for name, ok in same.items() if not ok]


def fully_shard_across_hosts() -> tuple[bool, list[str]]:
    """fully_shard on a group whose ranks say they are on different hosts: the collectives find no arena and
    take Gloo's calls with scratch buffers (the front end hands the same parts either way); every step equals the
    shared-memory run, bitwise. Returns that, and the fallback lines logged."""
    import logging

    from torch.distributed.device_mesh import DeviceMesh

    from tensorplay.distributed.fsdp import fully_shard

    def train(group: dist.ProcessGroup) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()
        return [p.full_tensor() for p in model.parameters()]

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    world = dist.get_world_size()
    shared = train(dist.new_group(list(range(world))))
    real = host_memory._host_id
    host_memory._host_id = lambda: 1000 + dist.get_rank()  # type: ignore[assignment]
    lines, logger = Lines(), logging.getLogger("tensorplay.distributed")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        apart = train(dist.new_group(list(range(world))))
    finally:
        host_memory._host_id = real  # type: ignore[assignment]
        logger.removeHandler(lines)
        logger.setLevel(level)
    return all(torch.equal(a, b) for a, b in zip(shared, apart, strict=True)), lines.lines


def test_fully_shard_across_hosts_equals_shared_memory():
    for same, lines in run_distributed(fully_shard_across_hosts):
        assert same
        assert len(lines) == 1 and "host" in lines[0], lines


def results_arrive_when_waited() -> dict[str, bool]:
    """Two all-gathers in flight through shared memory: issuing the second writes nothing of the first; the
    first's result is there once its handle is waited on; a third issue reads the oldest out (its slot is
    needed again), as documented."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    shard = torch.full((1 << 15,), float(rank + 1))
    outputs = [torch.full((world << 15,), -1.0) for _ in range(3)]
    expected = torch.cat([torch.full((1 << 15,), float(r + 1)) for r in range(world)])
    first = collectives.all_gather_flat(outputs[0], shard, group, async_op=True)
    second = collectives.all_gather_flat(outputs[1], shard, group, async_op=True)
    untouched_after_second_issue = bool((outputs[0] == -1).all())
    first.wait()
    seen = {"through shared memory": host_memory.arena_for(group) is not None,
            "first untouched by the second's issue": untouched_after_second_issue,
            "first there once waited": torch.equal(outputs[0], expected)}
    third = collectives.all_gather_flat(outputs[2], shard, group, async_op=True)
    fourth = collectives.all_gather_flat(outputs[0], shard, group, async_op=True)  # slot of the second needed
    seen["oldest read out when its slot is needed"] = torch.equal(outputs[1], expected)
    for pending in (second, third, fourth):
        pending.wait()
    seen["all right"] = all(torch.equal(out, expected) for out in outputs)
    return seen


def test_completion_is_the_handle_not_the_next_issue():
    for seen in run_distributed(results_arrive_when_waited, world_size=2):
        assert all(seen.values()), seen


def _map_then_grow_while_a_peer_is_late(rank: int, port: int, queue: Any) -> None:
    """Map the arena with one all-gather, then (rank 0) grow it while rank 1 is late: both are killed there."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    collectives.all_gather_flat(torch.empty(2 << 16), torch.ones(1 << 16))  # the arena is mapped
    queue.put((rank, os.getpid()))
    if rank == 1:
        time.sleep(60)  # late: rank 0 waits for it in the next, larger all-gather
    collectives.all_gather_flat(torch.empty(2 << 18), torch.ones(1 << 18))


def test_nothing_is_left_in_dev_shm_when_every_rank_is_killed():
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_map_then_grow_while_a_peer_is_late, args=(rank, port, queue), daemon=True)
             for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        pids = dict(queue.get(timeout=120) for _ in procs)
        time.sleep(1.0)  # rank 0 is now in the second all-gather, growing its slots, waiting for rank 1
        assert all(proc.is_alive() for proc in procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(timeout=10)
    assert [proc.exitcode for proc in procs] == [-signal.SIGKILL] * 2
    assert made_by(pids.values()) == []
