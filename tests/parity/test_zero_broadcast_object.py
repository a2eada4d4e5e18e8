"""``zero_redundancy_optimizer._broadcast_object`` against PyTorch's, on 2 ranks (Gloo)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tensorplay.distributed.optim.zero_redundancy_optimizer import _broadcast_object
from tensorplay.testing.distributed import run_distributed


def _payload(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    return {"state": {0: {"exp_avg": torch.randn(3, 2, generator=g), "step": torch.tensor(4.0)}},
            "groups": [{"lr": 0.1 * (rank + 1), "params": [0]}], "name": f"rank{rank}", "pair": (rank, [rank])}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _rank_fn() -> dict[str, Any]:
    from torch.distributed.optim.zero_redundancy_optimizer import (
        _broadcast_object as theirs,
    )
    rank = dist.get_rank()
    subgroup = dist.new_group([0, 1])
    results = {}
    for src in (0, 1):
        mine = _payload(rank)
        ours = _broadcast_object(mine, src_rank=src)
        torch_result = theirs(_payload(rank), src_rank=src)
        ours_sub = _broadcast_object(_payload(rank), src, subgroup, torch.device("cpu"))
        results[src] = {
            "equal_to_torch": _equal(ours, torch_result),
            "equal_to_source": _equal(ours, _payload(src)),
            "subgroup": _equal(ours_sub, _payload(src)),
            "source_gets_same_object": (ours is mine) if rank == src else None,
        }
    return results


def test_broadcast_object_equals_pytorch() -> None:
    for rank, results in enumerate(run_distributed(_rank_fn, world_size=2)):
        for src, result in results.items():
            assert result["equal_to_torch"] and result["equal_to_source"] and result["subgroup"], (rank, src)
            assert result["source_gets_same_object"] in (None, True)
