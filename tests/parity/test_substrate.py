"""tensorplay.distributed collectives, RPC and the multi-rank harness itself."""

from __future__ import annotations

import time

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import RankFailure, RankTimeout, run_distributed, run_rpc


def collectives() -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    summed = tp.full((3,), float(rank + 1))
    dist.all_reduce(summed)
    gathered = [tp.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, tp.full((2,), float(rank)))
    scattered = tp.zeros(2)
    dist.reduce_scatter_tensor(scattered, tp.arange(2.0 * world))
    broadcast = tp.full((2,), float(rank))
    dist.broadcast(broadcast, src=1)
    return {"sum": summed, "gathered": torch.cat(gathered), "scattered": scattered, "broadcast": broadcast}


def test_collectives_two_ranks():
    r0, r1 = run_distributed(collectives, world_size=2)
    for result in (r0, r1):
        assert torch.equal(result["sum"], torch.full((3,), 3.0))
        assert torch.equal(result["gathered"], torch.tensor([0.0, 0, 1, 1]))
        assert torch.equal(result["broadcast"], torch.full((2,), 1.0))
    assert torch.equal(r0["scattered"], torch.tensor([0.0, 2.0]))
    assert torch.equal(r1["scattered"], torch.tensor([4.0, 6.0]))


def _square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def rpc_round_trip() -> torch.Tensor | None:
    from tensorplay.distributed import rpc

    if rpc.get_worker_info().id == 0:
        return rpc.rpc_sync("worker1", _square, args=(tp.arange(3.0),))
    return None


def test_rpc_round_trip():
    r0, r1 = run_rpc(rpc_round_trip, world_size=2)
    assert torch.equal(r0, torch.tensor([0.0, 1.0, 4.0])) and r1 is None


def raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom from the test")
    return dist.get_rank()


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailure) as info:
        run_distributed(raise_on_rank_one, world_size=2)
    assert list(info.value.failures) == [1]
    assert "rank(s) 1 failed" in str(info.value) and "ValueError: boom from the test" in str(info.value)


def hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    return None


def test_hang_fails_within_timeout():
    # Start the workers first (the failing-rank test above replaced them): on a loaded 2-core machine spawning
    # them alone can take most of the 5 s, and then rank 1 would be named too.
    assert run_distributed(dist.get_rank, world_size=2) == [0, 1]
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank\(s\) \[0\] did not finish within 5s"):
        run_distributed(hang_on_rank_zero, world_size=2, timeout=5)
    assert time.monotonic() - start < 30
    # The pool was replaced: the next call works.
    assert run_distributed(dist.get_rank, world_size=2) == [0, 1]


def test_collective_before_init_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises((RuntimeError, ValueError), match="init_process_group"):
        dist.all_reduce(tp.ones(1))
