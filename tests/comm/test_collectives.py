"""The composed Gloo collectives (and the shared-memory ones) equal the native ones (2 and 3 ranks)."""

from __future__ import annotations

import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives
from tensorplay.testing.distributed import run_distributed


def gather_and_scatter_every_plan() -> dict[str, list[torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.arange(5.0) + 10 * rank
    full = torch.arange(5.0 * world) * (rank + 1)
    results: dict[str, list[torch.Tensor]] = {}
    saved = collectives.PLANS["gloo"]
    try:
        exchange = [("broadcast", "exchange")] if world == 2 else []
        for gather_algo, scatter_algo in [("native", "native"), ("broadcast", "all_reduce"),
                                          ("broadcast", "reduce"), ("broadcast", "composed"), *exchange,
                                          ("shared_memory", "shared_memory"), ("shared_memory", "composed")]:
            collectives.set_collective_plan("gloo", all_gather=gather_algo, reduce_scatter=scatter_algo)
            gathered = torch.empty(5 * world)
            collectives.all_gather_flat(gathered, shard, async_op=True).wait()
            reduced = torch.empty(5)
            collectives.reduce_scatter_flat(reduced, full.clone())
            results[f"{gather_algo}/{scatter_algo}"] = [gathered, reduced]
    finally:
        collectives.PLANS["gloo"] = saved
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_composed_collectives_match_native(world_size):
    for rank, results in enumerate(run_distributed(gather_and_scatter_every_plan, world_size=world_size)):
        native_gather, native_scatter = results["native/native"]
        expected_gather = torch.cat([torch.arange(5.0) + 10 * r for r in range(world_size)])
        expected_scatter = torch.arange(5.0 * world_size)[5 * rank: 5 * rank + 5] * sum(range(1, world_size + 1))
        assert torch.equal(native_gather, expected_gather)
        assert torch.equal(native_scatter, expected_scatter)
        for name, (gathered, reduced) in results.items():
            assert torch.equal(gathered, expected_gather), name
            assert torch.equal(reduced, expected_scatter), name


def exchange_against_all_reduce() -> dict[str, bool]:
    """Random floats (where the order of a sum would show): the two-rank exchange is bitwise the all-reduce."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    full = torch.randn(2 * 1001, generator=generator)
    saved = collectives.PLANS["gloo"]
    try:
        outputs = {}
        for algo in ("all_reduce", "exchange"):
            collectives.set_collective_plan("gloo", reduce_scatter=algo)
            outputs[algo] = torch.empty(1001)
            collectives.reduce_scatter_flat(outputs[algo], full.clone(), async_op=True).wait()
            inside = full.clone()  # the output is the input's own chunk
            own = inside.view(2, -1)[dist.get_rank()]
            collectives.reduce_scatter_flat(own, inside)
            outputs[f"{algo}/inside"] = own.clone()
    finally:
        collectives.PLANS["gloo"] = saved
    return {"separate": torch.equal(outputs["all_reduce"], outputs["exchange"]),
            "inside": torch.equal(outputs["all_reduce/inside"], outputs["exchange/inside"]),
            "inside_vs_separate": torch.equal(outputs["exchange"], outputs["exchange/inside"])}


def test_two_rank_exchange_is_bitwise_the_all_reduce():
    for result in run_distributed(exchange_against_all_reduce):
        assert result == {"separate": True, "inside": True, "inside_vs_separate": True}, result


def composed_against_native() -> bool:
    """Random floats of mixed magnitude (where the order of a sum shows): composed is bitwise the native."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    same = True
    for numel in (1, 7, 1000, 65537):
        full = torch.randn(world * numel, generator=generator) * 10.0 ** torch.randint(-3, 4, (world * numel,),
                                                                                         generator=generator)
        native = torch.empty(numel)
        torch.distributed.reduce_scatter_tensor(native, full.clone())
        composed = torch.empty(numel)
        collectives.reduce_scatter_flat(composed, full.clone(), async_op=True).wait()
        same = same and torch.equal(native, composed)
    return same


@pytest.mark.parametrize("world_size", [3, 4])
def test_composed_reduce_scatter_is_bitwise_the_native_one(world_size):
    assert run_distributed(composed_against_native, world_size=world_size) == [True] * world_size


def size_mismatch_message() -> str:
    try:
        collectives.all_gather_flat(torch.empty(7), torch.empty(3))
    except ValueError as error:
        return str(error)
    return "no error"


def test_size_mismatch_is_named():
    assert run_distributed(size_mismatch_message)[0] == "all_gather_flat: output has 7 elements, expected 2 ranks x 3"


def _refuse(*args, **kwargs):
    raise AssertionError("a group of one rank communicated")


def collectives_of_one_rank() -> dict[str, bool]:
    """Every collective on a group of one rank against Gloo's native call, with nothing sent: Gloo's calls and the
    shared-memory arena refuse while ours run (see [Note: a group of one rank])."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(100_003, generator=generator)  # from 64 KiB: the shared-memory size class
    native = {name: values.clone() for name in ("all_reduce", "broadcast", "gather", "scatter")}
    dist.all_reduce(native["all_reduce"])
    dist.broadcast(native["broadcast"], src=0)
    gathered_native, scattered_native = torch.empty_like(values), torch.empty_like(values)
    dist.all_gather_into_tensor(gathered_native, values)
    dist.reduce_scatter_tensor(scattered_native, values.clone())
    ours = {name: values.clone() for name in ("all_reduce", "broadcast")}
    gathered, scattered = torch.empty_like(values), torch.empty_like(values)
    into_parts = torch.empty(1, values.numel())
    saved = {name: getattr(collectives.dist, name) for name in
             ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")}
    saved_arena = collectives.arena_for
    try:
        for name in saved:
            setattr(collectives.dist, name, _refuse)
        collectives.arena_for = _refuse
        collectives.all_reduce(ours["all_reduce"], async_op=True).wait()
        collectives.broadcast(ours["broadcast"], 0)
        collectives.all_gather_flat(gathered, values)
        collectives.all_gather_flat(collectives.GatherParts([(0, into_parts)]), values)
        collectives.reduce_scatter_flat(scattered, values.clone())
        parts = collectives.FlatParts([(7, values[7:])], values.numel(), values.dtype, values.device, divide=2.0)
        halved = torch.empty_like(values)
        collectives.reduce_scatter_flat(halved, parts)
        future = collectives.all_reduce_future(values.clone())
    finally:
        for name, function in saved.items():
            setattr(collectives.dist, name, function)
        collectives.arena_for = saved_arena
    expected_halved = torch.cat([torch.zeros(7), values[7:] / 2])
    return {"all_reduce": torch.equal(ours["all_reduce"], native["all_reduce"]),
            "broadcast": torch.equal(ours["broadcast"], native["broadcast"]),
            "all_gather": torch.equal(gathered, gathered_native),
            "all_gather parts": torch.equal(into_parts[0], gathered_native),
            "reduce_scatter": torch.equal(scattered, scattered_native),
            "reduce_scatter parts": torch.equal(halved, expected_halved),
            "all_reduce_future": future.done() and torch.equal(future.value(), native["all_reduce"])}


def test_a_group_of_one_rank_sends_nothing_and_matches_native():
    [result] = run_distributed(collectives_of_one_rank, world_size=1)
    assert all(result.values()), [name for name, ok in result.items() if not ok]
