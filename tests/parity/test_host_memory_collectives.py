"""Shared-memory collectives (``_shard/host_memory.py``): bitwise the native ones where the sum order allows."""

from __future__ import annotations

import os

import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed._shard import collectives, host_memory
from tensorplay.testing.distributed import run_distributed


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
                everyone = torch.empty(world * world * numel, dtype=dtype)
                torch.distributed.all_gather_into_tensor(everyone, full)
                in_rank_order = everyone.view(world, world, numel)[:, rank]
                total = in_rank_order[0] + in_rank_order[1]
                for r in range(2, world):
                    total += in_rank_order[r]
                same[f"reduce-scatter {dtype} {numel} in rank order"] = torch.equal(reduced, total)
                if world == 2:
                    same[f"reduce-scatter {dtype} {numel} native"] = torch.equal(reduced, expected)
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
    finally:
        collectives.PLANS["gloo"] = saved
    return same


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_memory_collectives_match_native(world_size):
    for result in run_distributed(shared_against_native, world_size=world_size):
        assert all(result.values()), [name for name, ok in result.items() if not ok]


def default_plan_two_ranks() -> bool:
    """The default Gloo plan at two ranks reduces through shared memory, bitwise the native reduce-scatter."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    full = _mixed(2 * 4099, generator)
    native = torch.empty(4099)
    torch.distributed.reduce_scatter_tensor(native, full.clone())
    ours = torch.empty(4099)
    collectives.reduce_scatter_flat(ours, full.clone(), async_op=True).wait()
    arena = host_memory.arena_for(torch.distributed.distributed_c10d._get_default_group())
    return arena is not None and torch.equal(native, ours)


def test_default_two_rank_reduce_scatter_goes_through_shared_memory_bitwise():
    assert run_distributed(default_plan_two_ranks) == [True, True]


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
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith("tensorplay-")]
    expected = torch.cat([torch.arange(4.0), torch.arange(4.0) + 10])
    return host_memory.arena_for(group) is None, torch.equal(gathered, expected), leftovers


def test_ranks_on_different_hosts_fall_back_to_gloo():
    for no_arena, gathered, leftovers in run_distributed(ranks_on_different_hosts):
        assert no_arena and gathered
        assert leftovers == [], "a shared-memory file outlived its mapping"
